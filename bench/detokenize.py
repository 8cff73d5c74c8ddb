"""The frontend's detokenizer alone: microseconds per output token fed one at a time (as streams at a stream
interval of 1 feed it), with the default model's tokenizer, on each of its paths side by side: each token's
bytes from a table (byte-level BPE), the tokenizers library's DecodeStream, and the Python decode window.
Writes bench/results/detokenize.json (ratios: the table's time over DecodeStream's and over the window's).

    python bench/detokenize.py [--model default] [--repeats 5] [--name detokenize]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from executor_svc.model_loader import resolve_model_dir  # noqa: E402
from pagedserve.output.detokenizer import IncrementalDetokenizer  # noqa: E402
from tests.support.detokenizer_paths import StreamOnly, WindowOnly  # noqa: E402

TEXT = ("Streaming text back one token at a time: ASCII prose, code like `x = f(y) + 1`, numbers 3.14159, "
        "accents (café, naïve, Ångström), CJK (日本語のテキスト, 中文字符), emoji 😀👍🏽🇫🇷, and newlines\n\n")


def per_token_us(tokenizer, prompt_ids: list[int], ids: list[int], repeats: int) -> float:
    """The best of `repeats` runs over ids, one add_tokens call per token, then finish()."""
    best = float("inf")
    for _ in range(repeats):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        started = time.perf_counter()
        for token_id in ids:
            detokenizer.add_tokens([token_id])
        detokenizer.finish()
        best = min(best, time.perf_counter() - started)
    return best / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default="detokenize", help="result file name under bench/results/")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    text_ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    rng = random.Random(0)  # and ids a model might sample that make no sense together
    random_ids = [rng.randrange(len(tokenizer)) for _ in range(len(text_ids))]
    prompt_ids = tokenizer.encode("A prompt before the output", add_special_tokens=False)
    paths = {"byte_table": tokenizer, "decode_stream": StreamOnly(tokenizer), "python_window": WindowOnly(tokenizer)}
    for name, variant in paths.items():  # each path's text is the full decode's, or its time means nothing
        detokenizer = IncrementalDetokenizer(variant, prompt_ids)
        text = "".join(detokenizer.add_tokens([token_id]) for token_id in text_ids) + detokenizer.finish()
        assert text == tokenizer.decode(text_ids), name
    metrics = {"tokens": len(text_ids)}
    for kind, ids in (("text", text_ids), ("random_ids", random_ids)):
        metrics[kind] = {name: round(per_token_us(variant, prompt_ids, ids, args.repeats), 3)
                         for name, variant in paths.items()}
    ratios = {f"byte_table_vs_{other}_{kind}": round(metrics[kind]["byte_table"] / metrics[kind][other], 3)
              for kind in ("text", "random_ids") for other in ("decode_stream", "python_window")}
    path = write_result(args.name, ratios, metrics)
    print(path.read_text())


if __name__ == "__main__":
    main()
