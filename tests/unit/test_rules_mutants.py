"""Layout rules (pipetrain/parallel/mesh/rules.py) whose slips the default suite let through.

  R07  faults.kill_rank bounded by the mesh's world size without the parameter servers: a server (the ranks after
       the mesh) could not be named, though the fault-tolerance tests kill servers too
  R09  the divisor hint missing the square root (16 heads: "use one of 1, 2, 8, 16", without 4)
  R15  the vocabulary padding hint rounding down (64 at tp 3: "pad to 63", which tp does not divide either)
"""
from pipetrain.config import FaultsConfig, ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.parallel.mesh.rules import relaxed_problems, tensor_parallel_problems


def test_kill_rank_may_name_a_parameter_server_but_not_a_rank_beyond_them():
    def problems(kill_rank):
        recipe = Recipe(train=TrainConfig(global_batch=8), parallel=ParallelConfig(ps_servers=1),
                        faults=FaultsConfig(kill_rank=kill_rank))
        return [p for p in relaxed_problems(recipe, 2) if p.startswith("faults.kill_rank")]
    assert problems(2) == []  # mesh ranks 0 and 1, the server is rank 2
    assert problems(3) == ["faults.kill_rank: must be < the world size 3, got 3"]


def test_the_divisor_hint_lists_every_divisor():
    model = ModelConfig(family="llama", vocab_size=64, d_model=64, n_layers=2, n_heads=16, n_kv_heads=16,
                        ffn_hidden=48, max_seq_len=32)
    heads = [p for p in tensor_parallel_problems(model, 3) if "model.n_heads" in p]
    assert len(heads) == 1 and heads[0].endswith("use one of 1, 2, 4, 8, 16"), heads


def test_the_vocabulary_padding_hint_rounds_up_to_a_multiple_of_tp():
    model = ModelConfig(family="llama", vocab_size=64, d_model=48, n_layers=2, n_heads=3, n_kv_heads=3,
                        ffn_hidden=48, max_seq_len=32)
    vocab = [p for p in tensor_parallel_problems(model, 3) if "model.vocab_size" in p]
    assert len(vocab) == 1 and "pad the vocabulary to 66 " in vocab[0], vocab  # 64 -> 66 = 22 x 3
