"""Sweeps: one job array, one variant of the run per element, each in its own run directory.

    SWEEP="learning_rate=1e-5,3e-5,1e-4"                 three variants, --learning_rate each value
    SWEEP="learning_rate=1e-5,3e-5 lora_r=8,16"          several flags (space or ';' between them): every
                                                         combination, the last flag changing fastest (4 variants)

Submitted as an array of as many elements as variants: `qsub -J 1-3 ... pbs/run_llm.pbs` or
`sbatch --array=1-3 ... slurm/run_llm.slurm`; element i trains variant i in <sweep directory>/<variant name>, with
its flags after EXTRA_ARGS (so a swept flag wins over the same flag there). The sweep directory holds
llmft_sweep.json, which `llmft report <sweep directory>` reads to compare the variants.

Each flag must be one of `llmft train`'s (llmft.training.flag_policy.POLICY, the table tests/test_flags.py holds to
llmft train's own parser; standard library only, so the dry run and the job check it with any python3): a misspelt
one is refused, with "did you mean", in the dry run and in every element before anything trains.

A value cannot hold a comma inside `--export=...` or `-v ...` (the schedulers split there): quote the whole
value (`qsub -v "SWEEP='learning_rate=1e-5,3e-5'"`), or pass SWEEP=... as an argument after the script.
"""

from __future__ import annotations

import difflib
import itertools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from llmft.errors import LlmftError
from llmft.planning.methods import METHODS
from llmft.training.flag_policy import POLICY, REFUSED, all_flag_names, policy_for

SWEEP_FILE = "llmft_sweep.json"
# Flags the job sets from its knobs and run directory: a variant changing one would train somewhere else, or
# with a batch the plan never checked. Sweep the knob's value in separate submissions instead.
SET_BY_THE_JOB = ("output_dir", "global_batch_size", "per_device_train_batch_size", "deepspeed", "zero_stage")
_FLAG = re.compile(r"[a-z][a-z0-9_]*")
EXAMPLE = "e.g. SWEEP=learning_rate=1e-5,3e-5,1e-4 (several flags: 'learning_rate=1e-5,3e-5 lora_r=8,16')"


class SweepError(LlmftError, ValueError):
    """A SWEEP the job cannot run, or an array that does not match it; one line, exit 2."""


@dataclass(frozen=True)
class Variant:
    index: int  # 1-based: the array element that trains it
    name: str  # its run directory's name: flag-value pairs joined by '_'
    values: tuple[tuple[str, str], ...]

    def flags(self) -> list[str]:
        return [a for flag, value in self.values for a in (f"--{flag}", value)]

    def describe(self) -> str:
        return " ".join(f"{flag}={value}" for flag, value in self.values)


def parse(text: str) -> list[Variant]:
    """SWEEP's variants, in array order; a malformed SWEEP is refused naming the part and the form."""
    axes = []
    for part in [p for p in re.split(r"[;\s]+", text.strip()) if p]:
        flag, sep, values = part.partition("=")
        flag = flag.removeprefix("--")
        if not sep or not _FLAG.fullmatch(flag):
            raise SweepError(f"SWEEP={text}: '{part}' is not FLAG=VALUE,VALUE,...; {EXAMPLE}")
        check_flag(text, flag)
        if flag in SET_BY_THE_JOB:
            raise SweepError(
                f"SWEEP={text}: --{flag} is set by the job from its knobs and cannot vary within one sweep; submit a "
                "job for each value instead"
            )
        if flag in (a for a, _ in axes):
            raise SweepError(f"SWEEP={text}: {flag} is given twice; give each flag once with all its values")
        vals = values.split(",")
        if any(not v or "/" in v or v.startswith(".") for v in vals):
            raise SweepError(f"SWEEP={text}: {flag}={values} holds an empty value or one with '/'; {EXAMPLE}")
        if len(set(vals)) != len(vals):
            raise SweepError(f"SWEEP={text}: {flag} repeats a value; give each value once")
        axes.append((flag, vals))
    if not axes:
        raise SweepError(f"SWEEP={text} names no flag; {EXAMPLE}")
    combos = list(itertools.product(*[[(flag, v) for v in vals] for flag, vals in axes]))
    if len(combos) < 2:
        raise SweepError(f"SWEEP={text} has one variant: that is one run; drop SWEEP and give the flag in EXTRA_ARGS")
    return [Variant(i, "_".join(f"{f}-{v}" for f, v in combo), tuple(combo)) for i, combo in enumerate(combos, 1)]


def check_flag(text: str, flag: str) -> None:
    """A swept flag `llmft train` does not take, or refuses, would fail every element after its wait in the queue."""
    known = all_flag_names()  # every method's (a swept --beta is DPO's and KTO's)
    if flag not in known:
        close = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "llmft train --help lists its flags"
        raise SweepError(f"SWEEP={text}: --{flag} is not a flag of llmft train; {hint}")
    owners = [row for row in (policy_for(m) for m in METHODS) if flag in row]
    kind, why = POLICY[flag] if flag in POLICY else owners[0][flag]
    if kind == REFUSED:
        raise SweepError(f"SWEEP={text}: llmft train refuses --{flag} other than its default: {why}")


def element(variants: list[Variant], index: str | None, first: str | None, last: str | None, submit: str) -> Variant:
    """The variant this array element trains; an array that does not match the sweep is refused in every element
    (so no variant is silently left out or trained twice), naming the submission that matches."""
    n = len(variants)
    if index is None or index == "":
        raise SweepError(
            f"SWEEP has {n} variants, and this job is not an array: submit it as one, {submit.format(n=n)}"
        )
    if (first, last) != ("1", str(n)):
        raise SweepError(
            f"SWEEP has {n} variants, and this array's indices are {first}-{last}: submit it as {submit.format(n=n)}"
        )
    return variants[int(index) - 1]


def record(sweep_dir: Path, text: str, variants: list[Variant]) -> None:
    """llmft_sweep.json: the sweep and its variants' directories, for `llmft report`; written once, by any element
    (each writes the same content, atomically)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    body = {"sweep": text, "variants": [{"index": v.index, "name": v.name, "flags": v.flags()} for v in variants]}
    tmp = sweep_dir / f".{SWEEP_FILE}.{variants[0].index}.{id(body)}.tmp"
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(sweep_dir / SWEEP_FILE)


def variant_dirs(path: Path) -> list[Path] | None:
    """A sweep directory's variants' run directories, in order (None: not a sweep directory)."""
    f = path / SWEEP_FILE
    if not f.is_file():
        return None
    return [path / v["name"] for v in json.loads(f.read_text())["variants"]]


def main(argv: list[str] | None = None) -> int:
    """What slurm/run_llm.slurm reads, one line each, values as data:
    `python -m llmft.launch.sweep SWEEP`: the variants; `... SWEEP INDEX FIRST LAST`: this array element's (name=,
    count=, flags=, describe=); `... record DIR SWEEP`: write DIR/llmft_sweep.json. Errors: `error: ...`, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["record"]:
            record(Path(argv[1]), argv[2], parse(argv[2]))
            return 0
        variants = parse(argv[0])
        if len(argv) == 1:
            for v in variants:
                print(f"variant {v.index}: {v.describe()} -> {v.name}")
            print(f"count={len(variants)}")
            return 0
        v = element(variants, argv[1], argv[2], argv[3], "sbatch --array=1-{n} ... slurm/run_llm.slurm")
        print(f"name={v.name}")
        print(f"count={len(variants)}")
        print("flags=" + " ".join(v.flags()))
        print(f"describe={v.describe()}")
    except LlmftError as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
