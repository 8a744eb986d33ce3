"""Train the shipped byte-level BPE tokenizer on the shipped Shakespeare corpus.

    python scripts/train_tokenizer.py [--vocab 8192] [--out pipetrain/assets/tokenizer]

Writes a Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json) that
transformers.AutoTokenizer.from_pretrained(OUT) loads offline. Byte-level, so any text encodes;
<|endoftext|> separates documents. Training is deterministic for the same files and vocab size.
"""
import glob
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pipetrain.config import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = "<|endoftext|>"


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])  # one-line errors, exit 2
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--corpus", default=os.path.join(ROOT, "pipetrain/assets/shakespeare"))
    parser.add_argument("--out", default=os.path.join(ROOT, "pipetrain/assets/tokenizer"))
    args = parser.parse_args()
    alphabet = len(pre_tokenizers.ByteLevel.alphabet())  # 256 byte symbols, then <|endoftext|>
    if args.vocab < alphabet + 1:
        parser.error(f"--vocab {args.vocab} cannot hold the {alphabet} byte symbols and {EOS}; "
                     f"pass --vocab {alphabet + 1} or more")

    files = sorted(glob.glob(os.path.join(args.corpus, "*.txt")))
    if not files:
        parser.error(f"--corpus {args.corpus}: no .txt files there; name a folder of .txt files")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   model_max_length=1 << 30)
    fast.save_pretrained(args.out)
    print(f"trained on {len(files)} files: vocab {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
