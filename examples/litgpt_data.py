"""Real input for litgpt's ``pretrain`` with no download: standard library sources and a tokenizer trained on them.

``python examples/litgpt_data.py litgpt_data`` writes ``litgpt_data/text/NN.txt`` (a few modules of the running
Python's standard library, as litgpt's ``TextFiles`` data module reads them: the first file is the validation split)
and ``litgpt_data/tokenizer/`` (a byte-level BPE ``tokenizer.json`` of ``vocab_size`` tokens trained on that text
with the ``tokenizers`` package litgpt depends on, and a ``tokenizer_config.json`` naming its BOS/EOS tokens), which
``configs/litgpt_tiny.yaml`` points at. The same text gives the same tokenizer, byte for byte.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

MODULES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "shlex.py")
"""Standard library files (about 73 kB on Python 3.11) turned into ``text/00.txt`` ... ``text/04.txt``."""


def prepare(directory: str | Path, *, vocab_size: int = 512) -> Path:
    """Write ``text/`` and ``tokenizer/`` into ``directory``; return it as a ``Path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(directory)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in MODULES]
    (root / "text").mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (root / "text" / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    (root / "tokenizer").mkdir(exist_ok=True)
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    special["tokenizer_class"] = "PreTrainedTokenizerFast"  # litgpt's Tokenizer reads this key
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(special, indent=2), encoding="utf-8")
    return root


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(prepare(argv[0] if argv else "litgpt_data"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
