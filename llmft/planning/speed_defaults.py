"""Speed levers that llmft turns on by itself, each where it was measured at 1.1x or more with the same losses.

The measurements (bench/README.md, the GPU suite's H200 run of 2026-11-27: the Llama-3.2-1B shape, packed rows of 2048,
micro-batch 8 x 4, ZeRO-2, one GPU; docs/training.md lists them beside each default):

- gradient checkpointing off: 1.23x tokens/s (33.5 -> 41.1% MFU) for 23 GiB more GPU memory. Recomputation changes no
  number the model computes, so the losses are the same; what it costs is memory, and the planner, within 10% of every
  peak measured on a GPU, says whether a run has it. Not measured on CPU processes, where TRL's default stays.
- torch.compile: 1.30x (43.6% MFU), losses equal to the fourth digit, after a 131 s compile of the first step: it pays
  once a run trains longer than 131 / (1 - 1/1.30) = 568 s. Measured on packed rows (fixed shapes; padding-free
  batches change shape every step, and each new shape compiles again), full fine-tuning under ZeRO-2 on a bf16 GPU;
  llmft turns it on only there, and only for a run planned to train at least twice that long, so that a planner's
  tokens/s estimate off by 2x still leaves the compile paid for. LoRA, ZeRO-3 and sequence parallelism under compile
  are not measured: there it stays off unless asked for.

Each function takes the hardware and the run's facts and returns (decision, the log line that says it; empty: nothing
to say). Asked for either way, a lever is what was asked.
"""

from __future__ import annotations

from collections.abc import Callable

RECOMPUTATION_OFF_SPEEDUP = 1.23  # H200, 2026-11-27: packed-no-ckpt against packed (bench/README.md)
COMPILE_SPEEDUP = 1.30  # H200, 2026-11-27: packed-compile against packed
COMPILE_SECONDS = 131.0  # the same run's first step, compiling the 16-layer model
COMPILE_MEASURED_LAYERS = 16
COMPILE_PAYBACK_MARGIN = 2.0  # train at least this many times the break-even before compiling by default


def choose_recomputation(
    requested: bool | None, gpu, fits_without: bool | None, needs_gib: float | None, has_gib: float | None
) -> tuple[bool, str]:
    """Gradient checkpointing for a run whose setting (ZeRO stage, offload, micro-batch) is already chosen.

    requested: --gradient_checkpointing as given (None: not given). fits_without: the planner's answer for this run
    without recomputation (None: no plan could be made, for example a config that cannot be read here); needs_gib and
    has_gib: its per-GPU total and the GPU's usable memory, for the line. Not given: off on a GPU where the plan fits
    without it, else TRL's default (on)."""
    if requested is not None:
        return requested, ""
    if gpu is None:
        return True, ""  # CPU processes: nothing measured; TRL's default
    if fits_without is None:
        return True, "gradient checkpointing on (TRL's default: no memory plan could be made for this model here)"
    if fits_without:
        return False, (
            f"gradient checkpointing off (auto: this run fits without recomputation, {needs_gib:.1f} of "
            f"{has_gib:.1f} GiB planned per GPU; {RECOMPUTATION_OFF_SPEEDUP}x tokens/s measured on an H200); "
            "--gradient_checkpointing true keeps it on"
        )
    return True, (
        f"gradient checkpointing on (auto: without recomputation this run needs {needs_gib:.1f} GiB per GPU of "
        f"{has_gib:.1f}); --gradient_checkpointing false turns it off"
    )


def compile_seconds(layers: int) -> float:
    """The first step's compile time, scaled from the measured 16-layer model by the layer count: Dynamo traces every
    layer of the unrolled model and Inductor compiles what it traced (a model, not a measurement, above 16 layers)."""
    return COMPILE_SECONDS * max(layers, 1) / COMPILE_MEASURED_LAYERS


def compile_break_even_seconds(layers: int) -> float:
    """Training time after which the compile has paid for itself at the measured speed-up."""
    return compile_seconds(layers) / (1 - 1 / COMPILE_SPEEDUP)


def choose_torch_compile(
    requested: bool | None,
    gpu,
    *,
    packing: bool,
    zero_stage: int,
    use_peft: bool,
    sequence_parallel: int,
    layers: int,
    planned_train_s: Callable[[], float | None],
) -> tuple[bool, str]:
    """torch.compile for a run. requested: --torch_compile as given (None: not given). planned_train_s: asked only
    where compile could apply, the planner's training time for what the run has left to train (tokens / its tokens/s
    estimate; None: not known). Not given: on only where it was measured (module docstring) and the run is planned to
    train at least COMPILE_PAYBACK_MARGIN x the break-even."""
    if requested is not None:
        return requested, ""
    if gpu is None or not gpu.has_bf16:
        return False, ""
    if not packing or use_peft or zero_stage > 2 or sequence_parallel > 1:
        return False, ""  # not measured: padding-free shapes change every step; LoRA, ZeRO-3, Ulysses under compile
    train_s = planned_train_s()
    if train_s is None:
        return False, ""
    need = COMPILE_PAYBACK_MARGIN * compile_break_even_seconds(layers)
    if train_s < need:
        return False, (
            f"torch.compile off (auto: this run is planned to train {train_s / 60:.0f} min; compiling "
            f"{layers} layers takes about {compile_seconds(layers):.0f} s and pays from {need / 60:.0f} min); "
            "--torch_compile true turns it on"
        )
    return True, (
        f"torch.compile on (auto: packed rows, planned {train_s / 60:.0f} min of training; "
        f"{COMPILE_SPEEDUP}x tokens/s after a {COMPILE_SECONDS:.0f} s compile measured on an H200); "
        "--torch_compile false turns it off"
    )
