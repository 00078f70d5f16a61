"""What a line-by-line JSONL check costs next to loading the same file with `datasets`.

llmft names the line of a malformed .jsonl record by parsing the file itself. Done up front on every
load, that pass would cost most of a second load; so llmft runs it only after `datasets` has failed.
This prints both times side by side, on a generated file (no download), to show why; and the cost of the
UTF-8 pass llmft does run before every load of a text file.

    python bench/bench_data_check.py                  # 200,000 prompt/completion records
    python bench/bench_data_check.py --records 1000000
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from llmft.data.loading import check_jsonl, check_utf8
from llmft.data.synthetic import as_format, make_examples, write_jsonl


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from datasets import disable_caching, load_dataset

    disable_caching()
    tmp = Path(tempfile.mkdtemp(prefix="llmft-bench-data-"))
    try:
        path = write_jsonl(as_format(make_examples(args.records), "prompt_completion"), tmp / "data.jsonl")
        size_mb = path.stat().st_size / 2**20
        check = best_of(args.repeats, lambda: check_jsonl(path))
        fresh = iter(range(args.repeats))  # a new cache directory each time: a cached Arrow file is not a load
        load = best_of(
            args.repeats,
            lambda: load_dataset(
                "json", data_files=str(path), split="train", cache_dir=str(tmp / f"cache{next(fresh)}")
            ),
        )
        print(f"file: {args.records} records, {size_mb:.1f} MiB (best of {args.repeats})")
        print(f"{'step':<32}{'seconds':>10}")
        print(f"{'llmft check_jsonl':<32}{check:>10.2f}")
        print(f"{'datasets load_dataset(json)':<32}{load:>10.2f}")
        utf8 = best_of(args.repeats, lambda: check_utf8(path))
        print(f"{'llmft check_utf8':<32}{utf8:>10.3f}")
        print(
            f"check / load = {check / load:.2f}: checking up front would add {100 * check / load:.0f}% to every load; "
            "llmft checks only after a load fails, so a good file pays nothing"
        )
        print(
            f"utf8 / load = {utf8 / load:.3f}: the UTF-8 pass runs before every load of a text file "
            "(pyarrow accepts invalid UTF-8 in JSON strings without a word)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
