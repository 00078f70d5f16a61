"""What llmft does with every flag `llmft train` accepts (llmft.training.flag_policy.POLICY names each field of
TRL's ScriptArguments, SFTConfig and ModelConfig and of llmft's LlmftArguments): check_flags refuses the values llmft
cannot honour, and TrainParser is TRL's parser with llmft's differences. No flag is accepted and silently ignored.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trl import TrlParser

from llmft.errors import LlmftError
from llmft.planning.collective_timeout import STARTUP_S
from llmft.planning.ds_config import load_config, template_path
from llmft.planning.methods import METHODS, MIXIN_FLAGS, Method, method
from llmft.training.flag_names import unknown_flag_message
from llmft.training.flag_policy import REFUSED, policy_for


class FlagError(LlmftError, ValueError):
    """A flag llmft cannot honour with this value; the message says why and what to do instead."""


LORA_FLAGS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
)


def default_of(obj, name: str):
    """The dataclass default of a field (what the value is when the flag is not given)."""
    f = next(f for f in dataclasses.fields(obj) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _given(obj, name: str) -> bool:
    value, default = getattr(obj, name), default_of(obj, name)
    if value in (None, "", [], {}) and default in (None, "", [], {}):
        return False
    return value != default


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(getattr(value, "value", value))


def import_class(spec: str):
    """The class a method entry names as "module:attribute" (llmft.planning.methods), imported."""
    import importlib

    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def method_argument(argv: list[str]) -> str | None:
    """--method's value from the command line, else the --config YAML's `method:`, else None (the default, sft):
    read before the parser is built, since the method chooses the config dataclass the parser reads."""
    for i, arg in enumerate(argv):
        if arg == "--method" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--method="):
            return arg.split("=", 1)[1]
    config = config_keys(argv)
    value = config.get("method")
    return None if value is None else str(value)


def config_keys(argv: list[str]) -> dict:
    """The --config YAML's mapping ({} without one, or when it cannot be read: the parser names that problem)."""
    import yaml

    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return {}
    try:
        with open(argv[argv.index("--config") + 1]) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def method_fields(entry: Method) -> set[str]:
    """The flag names of a method's TRL config (its dataclass fields)."""
    return {f.name for f in dataclasses.fields(import_class(entry.config_class)) if f.init}


def check_method_flags(argv: list[str], entry: Method, shared: set[str]) -> None:
    """A flag (on the command line or in --config YAML) that only another method's config has is refused, naming the
    method(s) it belongs to: --beta with --method sft is never ignored, nor reported as an unknown flag."""
    given = [a[2:].split("=", 1)[0] for a in argv if a.startswith("--")] + list(config_keys(argv))
    own = method_fields(entry) | shared
    others = {m.name: method_fields(m) for m in METHODS.values() if m.name != entry.name}
    for name in given:
        bare = name[3:] if name.startswith("no_") and name not in own else name
        if bare in own:
            continue
        owners = [m for m, fields in others.items() if bare in fields]
        if owners:
            raise FlagError(
                f"--{bare} is a flag of --method {', '.join(owners)}, not of --method {entry.name}: "
                f"add --method {owners[0]}, or drop --{bare}"
            )


def check_method_features(llmft_args, entry: Method) -> None:
    """An llmft feature whose trainer mixin this method lacks (llmft.planning.methods.MIXIN_FLAGS: Ulysses is SFT's
    alone) is refused in one line, not run without it."""
    for flag, mixin in MIXIN_FLAGS.items():
        if mixin not in entry.mixins and _given(llmft_args, flag):
            having = [m.name for m in METHODS.values() if mixin in m.mixins]
            raise FlagError(
                f"--{flag} {_show(getattr(llmft_args, flag))} is not supported with --method {entry.name}: "
                f"it runs with --method {', '.join(having)} only; drop --{flag}"
            )


def check_flags(script_args, training_args, model_args, *, cuda: bool, method_name: str | None = None) -> None:
    """Refuse every flag value llmft cannot honour, before anything loads; the message names the flag and why.
    The policy is the method's (llmft.training.flag_policy.policy_for): a DPO --padding_free is refused."""
    policy = policy_for(method_name)
    for obj in (script_args, training_args, model_args):
        for f in dataclasses.fields(obj):
            kind, why = policy.get(f.name, (None, ""))
            if kind == REFUSED and f.init and _given(obj, f.name):
                raise FlagError(f"--{f.name} {_show(getattr(obj, f.name))} is not supported: {why}")
    if not model_args.use_peft:
        lora = [name for name in LORA_FLAGS if _given(model_args, name)]
        if lora:
            raise FlagError(
                f"--{lora[0]} is a LoRA setting but --use_peft is not given: add --use_peft, or drop the LoRA flags"
            )
    if getattr(training_args, "llmft_output_dir_given", True) is False:
        raise FlagError(
            "--output_dir is required: checkpoints, the resolved DeepSpeed config and the run record go there, and a "
            "rerun with the same directory resumes; add --output_dir runs/NAME"
        )
    out = training_args.output_dir
    if out and Path(out).exists() and not Path(out).is_dir():
        raise FlagError(f"--output_dir {out} is a file, not a directory: choose another --output_dir")
    if training_args.use_cpu == cuda:
        raise FlagError(
            "--use_cpu true, but CUDA GPUs are visible: llmft trains on them; to train on CPU hide them (CUDA_VISIBLE_DEVICES=)"
            if cuda
            else "--use_cpu false, but no CUDA GPU is visible here: drop --use_cpu (llmft trains on CPU without GPUs)"
        )
    if getattr(training_args, "activation_offloading", False) and not cuda:
        raise FlagError(
            "--activation_offloading moves activations from GPU memory to host RAM; without a CUDA GPU they are in "
            "host memory already: drop it"
        )
    if training_args.learning_rate < 0:
        raise FlagError(f"--learning_rate {training_args.learning_rate} is negative: give a positive learning rate")
    if training_args.max_length is not None and training_args.max_length < 1:
        raise FlagError(f"--max_length {training_args.max_length} must be a positive number of tokens")
    if training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise FlagError(
            f"--num_train_epochs {training_args.num_train_epochs:g} trains nothing: give a positive number "
            "of epochs or --max_steps"
        )


def check_profile_step(profile_step: int | None, max_steps: int) -> None:
    """--profile_step N: a step that runs, with steps after it for the rates (run_summary.json leaves N out)."""
    if profile_step is None:
        return
    if profile_step < 1 or 0 < max_steps <= profile_step:
        last = f" to {max_steps - 1}" if max_steps > 1 else ""
        raise FlagError(
            f"--profile_step {profile_step}: give a step from 1{last}, before the run's last: the rates in "
            "run_summary.json are taken over the steps after it"
        )


class TrainParser(TrlParser):
    """TRL's parser for `llmft train`, with differences that keep parsing from deciding what llmft decides.

    - flags match only by their full name (allow_abbrev=False): argparse would run `--max_step 4` as --max_steps, and a
      prefix can land on the wrong flag; a prefix is an unknown flag, named with "did you mean" (llmft.training.flag_names).
    - --output_dir is recorded as given or not (SFTConfig turns a missing one into ./trainer_output): llmft train
      refuses to run without it (check_flags), naming the fix.

    - --bf16/--fp16 are recorded as given (from the command line or --config YAML) and handed to SFTConfig as
      False: TRL turns bf16 on by default and HF then checks, while parsing, whether the GPU has bf16 (on a T4
      it fails, or passes through emulation, depending on the PyTorch version). llmft maps the flags onto its
      own decision (llmft.planning.hardware.choose_precision) and sets them on the Trainer's arguments afterwards.
    - a --deepspeed file is read with llmft's checks first, so a missing or malformed JSON is named.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.output_dir_given = True
        # None: not given (SFTConfig's default False cannot tell "not given" from "false"); llmft decides padding_free
        # and Liger itself when not given (llmft.packing.choose_padding_free, llmft.planning.hardware.choose_liger)
        self.set_known_defaults(fp16=None, padding_free=None, use_liger_kernel=None)
        # None: not given; llmft then decides recomputation and torch.compile by the measurements
        # (llmft.planning.speed_defaults), and hands SFTConfig TRL's defaults (on, off) until it has
        self.set_defaults(gradient_checkpointing=None, torch_compile=None)
        self.speed_flags_given = {"gradient_checkpointing": True, "torch_compile": True}
        self.precision_flags: dict[str, bool | None] = {"bf16": None, "fp16": None}
        # None: not given; llmft then sizes the collective timeout from the run (llmft.training.process_group_timeout)
        if any("--ddp_timeout" in a.option_strings for a in self._actions):
            self.set_defaults(ddp_timeout=None)
        self.ddp_timeout_given = False

    def set_known_defaults(self, **defaults) -> None:
        """set_defaults for the flags this parser has (a method's config lacks some of SFT's: KTO has no
        padding_free), so no value without a field is left over."""
        dests = {a.dest for a in self._actions}
        self.set_defaults(**{k: v for k, v in defaults.items() if k in dests})

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if hasattr(ns, "gradient_checkpointing") and hasattr(ns, "torch_compile"):
            given = ns.gradient_checkpointing is not None or getattr(ns, "activation_checkpointing", None) is not None
            self.speed_flags_given = {"gradient_checkpointing": given, "torch_compile": ns.torch_compile is not None}
            if not given:
                ns.gradient_checkpointing = True  # TRL's SFTConfig default
            if ns.torch_compile is None:
                ns.torch_compile = False
        if getattr(ns, "activation_checkpointing", False) is None and hasattr(ns, "gradient_checkpointing"):
            # transformers 5 renamed it: the value (TRL's default, --gradient_checkpointing or the YAML key) goes to the
            # new name, so TrainingArguments does not warn "`gradient_checkpointing` is deprecated" on every rank
            ns.activation_checkpointing, ns.gradient_checkpointing = ns.gradient_checkpointing, None
            if getattr(ns, "activation_checkpointing_kwargs", False) is None:
                ns.activation_checkpointing_kwargs, ns.gradient_checkpointing_kwargs = (
                    ns.gradient_checkpointing_kwargs,
                    None,
                )
        if hasattr(ns, "output_dir"):
            self.output_dir_given = ns.output_dir not in (None, "")
        if hasattr(ns, "ddp_timeout"):
            self.ddp_timeout_given = ns.ddp_timeout is not None
            ns.ddp_timeout = int(STARTUP_S) if ns.ddp_timeout is None else ns.ddp_timeout
        if hasattr(ns, "bf16") and hasattr(ns, "fp16"):
            self.precision_flags = {"bf16": ns.bf16, "fp16": ns.fp16}
            ns.bf16, ns.fp16 = False, False
        if isinstance(getattr(ns, "deepspeed", None), str) and not ns.deepspeed.lstrip().startswith("{"):
            load_config(template_path(None, deepspeed=ns.deepspeed))
        return ns, rest

    def parse_args_into_dataclasses(self, *args, return_remaining_strings: bool = False, **kwargs):
        out = super().parse_args_into_dataclasses(*args, return_remaining_strings=True, **kwargs)
        if not return_remaining_strings:  # HF's "Some specified arguments are not used" names no fix: llmft's does
            out, rest = out[:-1], out[-1]
            if rest:
                known = [s for a in self._actions for s in a.option_strings]
                if self.prog.endswith("train"):  # taken by llmft train before this parser (llmft.training.launcher)
                    known.append("--nproc_per_node")
                raise FlagError(unknown_flag_message(rest, known, self.prog))
        for obj in out:
            if hasattr(obj, "output_dir") and hasattr(obj, "save_total_limit"):  # SFTConfig: read by check_flags
                obj.llmft_output_dir_given = self.output_dir_given
                obj.llmft_speed_flags_given = dict(self.speed_flags_given)
            if hasattr(obj, "bf16_flag"):
                obj.bf16_flag, obj.fp16_flag = self.precision_flags["bf16"], self.precision_flags["fp16"]
                obj.ddp_timeout_given = self.ddp_timeout_given
        return out


def parse_train_flags(parser, argv: list[str] | None):
    """Parse `llmft train`/`llmft prepare` flags (and --config YAML): the four argument objects, or the one-line
    message for flags HF/TRL reject in __post_init__ or a --config file that cannot be read."""
    import yaml

    argv = list(argv) if argv is not None else None
    try:
        if argv is not None:
            check_method_flags(argv, method(getattr(parser, "method_name", None)), parser_flags(parser))
        return parser.parse_args_and_config(args=argv)
    except LlmftError as e:
        return str(e)
    except (ValueError, OSError, yaml.YAMLError) as e:
        if isinstance(e, OSError):
            return f"cannot read {e.filename or 'the --config file'}: {e.strerror or e}"
        if isinstance(e, yaml.YAMLError):
            return f"the --config file is not valid YAML: {str(e).strip().splitlines()[0]}"
        return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__


def parser_flags(parser) -> set[str]:
    """The long flag names a parser takes (without the dashes)."""
    return {s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")}
