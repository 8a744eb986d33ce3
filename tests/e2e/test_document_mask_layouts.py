"""data.document_mask through train.py: every layout gives the single-process loss (tp 2 + sp, pp 2, dp 2)."""
import json
import os

import pytest

from tests.e2e.common import ROOT, run_train, step_losses
from tests.harness import TP_FP32

LOSS_TOL = TP_FP32["rtol"]
PLAY = os.path.join(ROOT, "pipetrain", "assets", "shakespeare", "hamlet_gut.txt")


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Hamlet's paragraphs as one JSON record each: many documents per 32-token window."""
    path = tmp_path_factory.mktemp("docs") / "paragraphs.jsonl"
    with open(PLAY, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()][:600]
    path.write_text("\n".join(json.dumps({"text": p}) for p in paragraphs))
    return str(path)


# The default run checks one two-process layout (tp 2 + sp: the mask crosses the sequence-parallel gather);
# the four-process layouts (dp 2 with tp 2 + sp, dp 2 with pp 2) and gpt2 run with -m slow.
TP2_SP = [("tp2sp", ["parallel.tp=2", "parallel.sequence_parallel=true"], 2)]
WIDE = [("tp2sp_dp2", ["parallel.tp=2", "parallel.sequence_parallel=true"], 4), ("pp2_dp2", ["parallel.pp=2"], 4)]


@pytest.mark.parametrize("family,layouts", [("llama", TP2_SP),
                                            pytest.param("llama", WIDE, marks=pytest.mark.slow, id="llama-wide"),
                                            pytest.param("gpt2", TP2_SP + WIDE, marks=pytest.mark.slow, id="gpt2")])
def test_document_mask_layouts_match_single_process(tmp_path, short_documents, family, layouts):
    unmasked = [f"data.path={short_documents}", f"model.family={family}", "train.steps=6", "run.eval_every=3",
                "parallel.microbatches=2"]
    common = unmasked + ["data.document_mask=true"]
    cache = str(tmp_path / "cache")
    proc, single = run_train(str(tmp_path / "single"), common, cache_dir=cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = step_losses(single)
    assert len(ref) == 6
    # Had the mask never been applied, every layout below would match ref and the unmasked run alike: the
    # parity checks mean something only when the unmasked losses sit far outside their tolerance.
    proc, plain = run_train(str(tmp_path / "unmasked"), unmasked, cache_dir=cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    apart = max(abs(a - b) / abs(b) for a, b in zip(step_losses(plain), ref))
    assert len(step_losses(plain)) == 6 and apart > 10 * LOSS_TOL, f"unmasked losses within {apart:.1e} of masked"
    for name, layout, nproc in layouts:
        proc, metrics = run_train(str(tmp_path / name), common + layout, nproc=nproc, cache_dir=cache)
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = step_losses(metrics)
        assert len(got) == 6, name
        for step, (a, b) in enumerate(zip(got, ref), start=1):
            assert abs(a - b) <= LOSS_TOL * abs(b), f"{name} step {step}: {a} vs single-process {b}"
        evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
        ref_evals = [m["eval_loss"] for m in single if "eval_loss" in m]
        assert len(evals) == len(ref_evals) == 2 and all(abs(a - b) <= LOSS_TOL * b for a, b in zip(evals, ref_evals))
