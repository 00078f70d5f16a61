"""Flags match only by their full name: the one line for a flag no parser knows, naming the flag it was probably meant.

argparse takes a prefix of a flag for the flag (`--max_step 4` runs as `--max_steps 4`), and a prefix can just as well
land on the wrong flag. Every llmft parser is built with allow_abbrev=False (llmft.command.CommandParser for plan,
infer, eval, report, tiny, demo and tracking; llmft.training.flags.TrainParser for train and prepare), so a prefix is
an unknown flag, and this message names the flags it begins ("did you mean"), or the closest known one.
"""

from __future__ import annotations

import difflib

FULL_NAMES_ONLY = "flags match only by their full name"


def canonical(known: list[str]) -> list[str]:
    """The long flags, once each (HF's parser also takes --max-steps for --max_steps: the underscore form is named),
    shortest first."""
    names = {k for k in known if k.startswith("--")}
    underscored = {k: "--" + k[2:].replace("-", "_") for k in names}
    out = {underscored[k] if underscored[k] in names else k for k in names}
    return sorted(out, key=lambda k: (len(k), k))


def unknown_flag_message(rest: list[str], known: list[str], command: str = "llmft train") -> str:
    """One line for arguments no parser takes: the first unknown flag and the known one(s) it was probably meant as."""
    flags = [a.split("=", 1)[0] for a in rest if a.startswith("-")]
    if not flags:
        return f"unexpected argument {rest[0]!r}: flags take the form --name value ({command} --help lists them)"
    flag = flags[0]
    more = f" (and {len(flags) - 1} more unknown)" if len(flags) > 1 else ""
    long_flags = canonical(known)
    typed = flag[:2] + flag[2:].replace("-", "_")
    completions = [k for k in long_flags if k.startswith(typed) and k != typed] if len(flag) > 2 else []
    if completions:
        if len(completions) == 1:
            names = completions[0]
        elif len(completions) <= 4:
            names = f"{', '.join(completions[:-1])} or {completions[-1]}"
        else:
            names = f"one of the {len(completions)} flags that begin {typed}: {', '.join(completions[:4])}, ..."
        return f"unknown flag {flag}{more}: did you mean {names}? ({FULL_NAMES_ONLY})"
    close = difflib.get_close_matches(flag, long_flags, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"{command} --help lists every flag"
    return f"unknown flag {flag}{more}: {hint}"
