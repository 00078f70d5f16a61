#!/usr/bin/env python3
"""Generate text straight from a DeepSpeed ZeRO checkpoint: the original workflow's entry point.

    python3 inference/inference.py my_gpt2_checkpoint/global_step65110 --prompt "Hello" --model_name gpt2 \\
        --device cuda:0 --max_new_tokens 50

A thin layer over `llmft.infer` (same options: `--prompt_file`, `--json`, `--merge`, ...; a model to serve is
`llmft export CHECKPOINT --out DIR`;
see `python3 inference/inference.py --help`). No DeepSpeed engine or process group is started.
"""

import sys
from pathlib import Path

try:
    import llmft.infer
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        import llmft.infer
    except ImportError as e:
        raise SystemExit(
            f"inference.py: error: {e.msg}: run it with llmft's environment (make venv; .venv/bin/python inference/inference.py ...) "
            "or pip install -e . first"
        ) from None


if __name__ == "__main__":
    parser = llmft.infer.make_parser()
    parser.prog = "inference.py"
    sys.exit(llmft.infer.main(parser.parse_args()))
