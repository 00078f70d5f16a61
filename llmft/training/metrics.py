"""How fast a run went and how far from the hardware's limit: tokens/s, FLOPs, MFU, memory, data wait, start-up.

Rank 0 logs one line per logging step (and the same numbers to W&B when it is on):

    llmft: step 40/128 loss 1.3786 lr 2.44e-03 tokens/s 3623 padded/s 5120 tflops/gpu 121.4 mfu 38.9% gpu_mem 61.2GiB data 0.4%

- tokens/s: non-padding tokens per second over all ranks; padded/s: every token fed to the model (padding included).
- tflops/gpu: model FLOPs per second per GPU; mfu: that over the GPU's dense 16-bit peak (llmft.planning.hardware.GPU.peak_tflops:
  L4 121, A100 312, H100/H200 989). A GPU without a known peak, or a CPU, gives no MFU (n/a, null), never a guess.
- gpu_mem: peak memory PyTorch allocated on any rank's GPU; data: share of the interval spent waiting for batches.
- save 12.3s / eval 4.5s: only in the line of an interval in which a checkpoint was saved or the model evaluated.

Every rate is over training time only: the interval's wall time less the time spent saving checkpoints
(`Trainer._save_checkpoint` and the on_save callbacks, which check and publish it) and evaluating
(`Trainer.evaluate`). That time is reported on its own: in the step line (above), in W&B as `save_seconds` and
`eval_seconds` per interval, and in run_summary.json as `save_seconds`/`eval_seconds` beside `train_seconds`.

At the end of a run (also one ended early by a stop signal), `<output_dir>/run_summary.json` holds the run's totals
(SUMMARY_FIELDS) and `startup_seconds` split into STARTUP_PHASES. Its rates leave out the first optimizer step,
which `startup_seconds.first_step` reports, so they describe the steady state; under torch.compile, which compiles
again when batch shapes change, they also leave out every logging interval up to the last one in which a rank compiled.

FLOPs per token (the convention of PaLM, appendix B, and llm-foundry, so MFU compares with their numbers):

    forward 2N + activation gradients 2N + weight gradients 2N_trainable, plus attention 12 * L * A * s

N counts the parameters used in matrix multiplies (embedding look-ups excluded, the LM head included, once even
when tied), N_trainable those of them that get weight gradients: full fine-tuning gives the usual 6N; under LoRA
the frozen weights still cost their forward and activation-gradient FLOPs (4N) and only the adapters add weight
gradients. L is the number of layers, A = attention heads x head dim, s the length of the sample the token is in
(QK^T and AV: 4*A*s per layer forward, 8*A*s backward; no discount for the causal mask). Per step that is
(4N + 2N_trainable) * tokens + 12 * L * A * sum(s^2) over the step's samples, counting real tokens only:
padding is not useful work. Recomputation under gradient checkpointing is not counted (that would be HFU, not
MFU). MoE models would need active rather than total parameters; llmft counts all of them.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STARTUP_PHASES = ("import", "data", "model_load", "deepspeed_init", "first_step")
SUMMARY_FIELDS = (
    "steps",
    "tokens",
    "padded_tokens",
    "tokens_per_second",
    "padded_tokens_per_second",
    "tflops_per_gpu",
    "mfu",
    "peak_gpu_memory_gib",
    "peak_host_rss_gib",
    "train_loss",
    "world_size",
    "gpu",
    "train_seconds",
    "save_seconds",
    "eval_seconds",
    "wall_seconds",
    "startup_seconds",
    "global_step",
)
NON_TRAINING = ("save", "eval")  # what the meter takes out of the training time and reports on its own


# --- FLOPs ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopShape:
    """What the FLOP count needs to know about a model."""

    matmul_params: int  # N: parameters used in matrix multiplies
    trainable_params: int  # N_trainable: of those, the ones that get weight gradients
    n_layers: int  # L
    attn_width: int  # A: attention heads x head dim (the width of QK^T and AV)
    # a frozen reference model's forward over the same tokens (DPO, KTO without precomputed log-probs): its
    # matmul parameters, 0 for none. Same architecture as the policy, so L and A are the policy's.
    reference_params: int = 0


def training_flops(shape: FlopShape, tokens: float, sum_sq_lengths: float) -> float:
    """Model FLOPs of one training pass over `tokens` real tokens in samples whose squared lengths sum to `sum_sq_lengths`:
    the policy's forward and backward (6N a token for full fine-tuning), and a reference model's forward (2N a token,
    its attention a third of a training pass's) where one scores the same tokens live."""
    dense = (4 * shape.matmul_params + 2 * shape.trainable_params + 2 * shape.reference_params) * tokens
    attention = (12 + (4 if shape.reference_params else 0)) * shape.n_layers * shape.attn_width * sum_sq_lengths
    return dense + attention


def flop_shape(model, live_reference: bool = False) -> FlopShape:
    """N, N_trainable, L and A of a (possibly PEFT-wrapped, possibly ZeRO-3-partitioned) transformers model; with
    `live_reference`, a reference of the same N runs a forward over every token (a copy, or the model with its
    adapter disabled: the same matmuls either way)."""
    import torch

    def numel(p) -> int:
        return int(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 leaves an empty tensor; ds_numel is the real size

    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    matmul = trainable = 0
    for p in model.parameters():
        if id(p) in lookups and p is not head_weight:  # a look-up table; a tied LM head is counted (once) as a matmul
            continue
        matmul += numel(p)
        trainable += numel(p) if p.requires_grad else 0
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 0
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 0
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    return FlopShape(matmul, trainable, int(layers), int(heads * head_dim), matmul if live_reference else 0)


def batch_counts(batch):
    """[real tokens, all tokens, sum of squared sample lengths] of one collated batch, as a float64 tensor on the
    batch's device (no host sync). Padded batches: lengths from the attention mask. Padding-free (packed) batches:
    lengths from `cu_seq_lens_q` or the restarts of `position_ids`; a right-padded tail (pad_to_multiple_of) is
    position 0 throughout and is left out (a 1-token sample at the very end is taken for padding too)."""
    import torch

    ids = batch["input_ids"]
    # torch.full launches a fill kernel; torch.tensor(..., device="cuda") would copy from the host and wait for the GPU
    total = torch.full((), float(ids.numel()), dtype=torch.float64, device=ids.device)
    mask = batch.get("attention_mask")
    if mask is not None:
        lengths = mask.sum(-1).to(torch.float64)
        return torch.stack([lengths.sum(), total, (lengths * lengths).sum()])
    pos = batch.get("position_ids")
    if pos is None:
        lengths = torch.full((ids.shape[0],), float(ids.shape[-1]), dtype=torch.float64, device=ids.device)
        return torch.stack([lengths.sum(), total, (lengths * lengths).sum()])
    pos = pos.reshape(-1)
    tail = (pos.flip(0) == 0).to(torch.int64).cumprod(0).sum().to(torch.float64)  # trailing padding, 1-token pieces
    real = total - tail
    if "cu_seq_lens_q" in batch:
        lengths = batch["cu_seq_lens_q"].to(pos.device).diff().to(torch.float64)
        sum_sq = (lengths * lengths).sum()
    else:  # a sample's positions 0..s-1 sum (2p + 1) to s^2: no torch.nonzero, which would sync a GPU with the host
        sum_sq = (2 * pos.to(torch.float64) + 1).sum()
    return torch.stack([real, total, sum_sq - tail])


def mfu(tflops_per_gpu: float | None, gpu) -> float | None:
    """Model FLOPs utilisation against the GPU's dense 16-bit peak; None without a GPU or a known peak."""
    if tflops_per_gpu is None or gpu is None or not gpu.peak_tflops:
        return None
    return tflops_per_gpu / gpu.peak_tflops


# --- Start-up clock -------------------------------------------------------------------------------------------------


def process_start_time() -> float:
    """When this process started (wall clock), from /proc; the import time of this module elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


class StartupClock:
    """Seconds spent in each start-up phase. Phases nest: time in an inner phase is taken out of the outer one
    (model loading inside SFTTrainer's construction counts as model_load, not data)."""

    def __init__(self, start: float | None = None):
        self.start = process_start_time() if start is None else start
        self.seconds = dict.fromkeys(STARTUP_PHASES, 0.0)
        self._stack: list[tuple[str, float]] = []

    def elapsed(self) -> float:
        return time.time() - self.start

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += max(seconds, 0.0)

    @contextmanager
    def phase(self, name: str):
        now = time.time()
        if self._stack:  # pause the outer phase
            outer, since = self._stack[-1]
            self.add(outer, now - since)
        self._stack.append((name, now))
        try:
            yield
        finally:
            name, since = self._stack.pop()
            now = time.time()
            self.add(name, now - since)
            if self._stack:
                self._stack[-1] = (self._stack[-1][0], now)

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}


@contextmanager
def timing_model_load(clock: StartupClock):
    """Count TRL's model loading (trl.trainer.sft_trainer.create_model_from_path) as the model_load phase while
    SFTTrainer is built; the rest of its construction (tokenising, packing) stays in the enclosing data phase."""
    from trl.trainer import sft_trainer

    original = getattr(sft_trainer, "create_model_from_path", None)
    if original is None:
        yield
        return

    def timed(*args, **kwargs):
        with clock.phase("model_load"):
            return original(*args, **kwargs)

    sft_trainer.create_model_from_path = timed
    try:
        yield
    finally:
        sft_trainer.create_model_from_path = original


# --- The meter: counts, timing, the step line and run_summary.json --------------------------------------------------


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far; 0 where it never ran (dynamo not even imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _peak_host_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def format_step_line(step: int, max_steps: int, loss: float, lr: float, m: dict) -> str:
    """The console line; its prefix `llmft: step N/M loss X lr Y` is what scripts and tests parse."""
    mfu_text = f"{m['mfu'] * 100:.1f}%" if m.get("mfu") is not None else "n/a"
    mem = f"{m['peak_gpu_memory_gib']:.1f}GiB" if m.get("peak_gpu_memory_gib") is not None else "n/a"
    return (
        f"llmft: step {step}/{max_steps} loss {loss:.4f} lr {lr:.2e} tokens/s {m['tokens_per_second']:.0f} "
        f"padded/s {m['padded_tokens_per_second']:.0f} tflops/gpu {m['tflops_per_gpu']:.4g} mfu {mfu_text} "
        f"gpu_mem {mem} data {m['data_wait_share'] * 100:.1f}%"
        + "".join(f" {kind} {m[f'{kind}_seconds']:.1f}s" for kind in NON_TRAINING if m.get(f"{kind}_seconds"))
    )


class Meter:
    """Counts every batch a rank trains on (without host syncs), times the data wait, and reduces over ranks only
    at logging steps and at the end. Built by `attach`."""

    def __init__(self, shape: FlopShape, gpu, clock: StartupClock, world_size: int):
        import torch

        self.shape, self.gpu, self.clock, self.world_size = shape, gpu, clock, world_size
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.counts = torch.zeros(
            3, dtype=torch.float64, device=self.device
        )  # real, all, sum s^2 (this rank, cumulative)
        self.data_seconds = 0.0  # this rank, cumulative
        self.outside = dict.fromkeys(NON_TRAINING, 0.0)  # seconds spent saving / evaluating, this rank, cumulative
        self._outside_depth = 0  # nested non-training calls (evaluate over several eval sets calls itself) count once
        self.steps = 0
        self.begin: float | None = None
        self.first: tuple | None = None  # (time, counts, data_seconds) where the steady state starts: the end of
        # the first step, or the first logging step after the last one at which any rank was compiling (torch.compile)
        self.steady_from = 1  # the step `first` was taken at
        self.steady_why = ""  # why it is not 1: torch.compile compiling, or a profiled step (--profile_step)
        self.graphs = 0  # compiled_graphs() at the end of the first step, then at each logging step
        self.any_compiled = False  # whether any rank compiled in the last reduced interval
        self.last: tuple | None = None  # the same at the last logging step
        self.totals: dict | None = None
        self.peak_gpu_gib: float | None = None
        self.peak_rss_gib = 0.0
        self.attached_at = time.time()
        self.extra: dict = {}  # more run_summary.json fields from other parts of the run (the reference's precompute)

    # Data: wrap the iterator Trainer.get_batch_samples pulls micro-batches from.
    def timed(self, iterator):
        meter = self

        class Timed:
            def __iter__(self):
                return self

            def __next__(self):
                t = time.perf_counter()
                batch = next(iterator)
                meter.data_seconds += time.perf_counter() - t
                meter.counts += batch_counts(batch).to(meter.device)
                return batch

        return Timed()

    @contextmanager
    def outside_training(self, kind: str):
        """Time spent saving or evaluating: taken out of the rates, reported as `<kind>_seconds`."""
        self._outside_depth += 1
        since = time.time()
        try:
            yield
        finally:
            self._outside_depth -= 1
            if self._outside_depth == 0:
                self.outside[kind] += time.time() - since

    def snapshot(self) -> tuple:
        return (time.time(), self.counts.clone(), self.data_seconds, dict(self.outside))

    def steady_after_this_step(self) -> None:
        """Start the rates after the step that just ended (every rank calls it at the same step): --profile_step's
        profiler overhead is in it."""
        self.first, self.steady_from = self.snapshot(), self.steps
        self.steady_why = f"step {self.steps} was profiled"

    def reduce(self, snapshots: list[tuple], compiled: bool = False) -> list[dict]:
        """Over all ranks: summed token counts and the highest data wait, memory and RSS (and whether any rank
        `compiled`, in self.any_compiled). One collective per kind."""
        import torch
        import torch.distributed as dist

        sums = torch.cat([s[1] for s in snapshots])
        peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else -1.0
        maxes = torch.tensor(
            [s[2] for s in snapshots] + [float(compiled), peak_gpu, _peak_host_rss_gib()],
            dtype=torch.float64,
            device=self.device,
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        sums, maxes = sums.tolist(), maxes.tolist()
        out = []
        for i, s in enumerate(snapshots):
            real, padded, sum_sq = sums[3 * i : 3 * i + 3]
            out.append(
                {
                    "time": s[0],
                    "tokens": real,
                    "padded_tokens": padded,
                    "sum_sq": sum_sq,
                    "data_seconds": maxes[i],
                    **{f"{kind}_seconds": s[3][kind] for kind in NON_TRAINING},
                }
            )  # this rank's own, like time
        self.any_compiled = maxes[-3] > 0
        self.peak_gpu_gib = maxes[-2] if maxes[-2] >= 0 else None
        self.peak_rss_gib = maxes[-1]
        return out

    def rates(self, a: dict, b: dict) -> dict:
        """Rates between two reduced snapshots (b later than a), over the training time between them: the wall time
        less saving and evaluating, which are given as `save_seconds` and `eval_seconds`."""
        outside = {f"{kind}_seconds": b[f"{kind}_seconds"] - a[f"{kind}_seconds"] for kind in NON_TRAINING}
        seconds = max(b["time"] - a["time"] - sum(outside.values()), 1e-9)
        tokens, padded = b["tokens"] - a["tokens"], b["padded_tokens"] - a["padded_tokens"]
        tflops = training_flops(self.shape, tokens, b["sum_sq"] - a["sum_sq"]) / seconds / self.world_size / 1e12
        return {
            "tokens_per_second": tokens / seconds,
            "padded_tokens_per_second": padded / seconds,
            "tflops_per_gpu": tflops,
            "mfu": mfu(tflops, self.gpu),
            "peak_gpu_memory_gib": self.peak_gpu_gib,
            "data_wait_share": min((b["data_seconds"] - a["data_seconds"]) / seconds, 1.0),
            **outside,
        }

    def summary(self, train_loss: float | None, global_step: int | None = None) -> dict:
        """run_summary.json's fields (SUMMARY_FIELDS); `reduce_totals` must have run on every rank."""
        t = self.totals
        if t is None:
            raise RuntimeError("Meter.summary before the end of training")
        start, first, end = t["start"], t["first"], t["end"]
        steady = self.rates(first, end) if self.steps > self.steady_from else self.rates(start, end)
        return {
            "steps": self.steps,
            "tokens": int(end["tokens"]),
            "padded_tokens": int(end["padded_tokens"]),
            "tokens_per_second": round(steady["tokens_per_second"], 2),
            "padded_tokens_per_second": round(steady["padded_tokens_per_second"], 2),
            "tflops_per_gpu": round(steady["tflops_per_gpu"], 6),
            "mfu": None if steady["mfu"] is None else round(steady["mfu"], 4),
            "peak_gpu_memory_gib": None if self.peak_gpu_gib is None else round(self.peak_gpu_gib, 3),
            "peak_host_rss_gib": round(self.peak_rss_gib, 3),
            "train_loss": None if train_loss is None else round(float(train_loss), 6),
            "world_size": self.world_size,
            "gpu": self.gpu.name if self.gpu is not None else None,
            "train_seconds": round(
                end["time"] - start["time"] - sum(end[f"{k}_seconds"] - start[f"{k}_seconds"] for k in NON_TRAINING), 3
            ),
            **{f"{kind}_seconds": round(self.outside[kind], 3) for kind in NON_TRAINING},  # the final save included
            "wall_seconds": round(time.time() - self.clock.start, 3),
            "startup_seconds": self.clock.rounded(),
            "global_step": None
            if global_step is None
            else int(global_step),  # the run's step (`steps`: this attempt's)
            **self.extra,
        }

    def write_summary(
        self, output_dir: str | Path, train_loss: float | None, global_step: int | None = None, held_out=None
    ) -> Path:
        """Write <output_dir>/run_summary.json atomically (rank 0 calls this): this attempt's summary; and append it
        to run_summaries.jsonl, one line per attempt (a requeued or resumed run keeps every attempt's time).
        `held_out`: the method's held-out metric ({"eval_accuracy": 0.75} for a reward model), appended."""
        summary = {**self.summary(train_loss, global_step), **(held_out or {})}
        path = Path(output_dir) / "run_summary.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
        with open(path.with_name(ATTEMPTS_FILE), "a") as f:
            f.write(json.dumps({**summary, "ended_at": round(time.time(), 3)}) + "\n")
        return path


ATTEMPTS_FILE = "run_summaries.jsonl"  # one run_summary per attempt of the run, oldest first


def keep_in_log_history(log_history: list[dict], step: int, metrics: dict) -> None:
    """Add the interval's throughput metrics to the Trainer's log-history entry of this loss log, so
    trainer_state.json (and `llmft report`) keep them: HF appends a copy of the logs before callbacks see them."""
    if log_history and log_history[-1].get("step") == step and "loss" in log_history[-1]:
        log_history[-1].update(metrics)


def _callback_class():
    from transformers import TrainerCallback

    class ThroughputCallback(TrainerCallback):
        """Marks the start-up phases, adds the throughput metrics to every loss log (so W&B records them),
        prints the step line on rank 0, and reduces the totals when training ends."""

        def __init__(self, meter: Meter):
            self.meter = meter

        def on_train_begin(self, args, state, control, **kwargs):
            m = self.meter
            m.begin = m.snapshot()
            m.clock.add("deepspeed_init", m.begin[0] - m.attached_at)  # data loader, DeepSpeed engine, resumed state
            m.last = None

        def on_step_end(self, args, state, control, **kwargs):
            m = self.meter
            m.steps += 1
            if m.steps == 1:
                m.first, m.graphs = m.snapshot(), compiled_graphs()
                m.clock.add("first_step", m.first[0] - m.begin[0])
                if state.is_world_process_zero:
                    phases = ", ".join(f"{k} {v:.1f}" for k, v in m.clock.seconds.items())
                    print(
                        f"llmft: start-up {m.first[0] - m.clock.start:.1f} s to the end of the first step ({phases})",
                        flush=True,
                    )

        def on_log(self, args, state, control, logs=None, **kwargs):
            m = self.meter
            if not logs or "loss" not in logs or m.begin is None:
                return
            now, graphs = m.snapshot(), compiled_graphs()
            before, after = m.reduce([m.last or m.begin, now], compiled=graphs != m.graphs)
            m.last, m.graphs = now, graphs
            if m.any_compiled and m.steps > 1:  # torch.compile was at work on some rank: the steady state starts here
                m.first, m.steady_from = now, m.steps
                m.steady_why = f"torch.compile compiled until step {m.steps}"
            rates = m.rates(before, after)
            kept = {k: round(v, 6) for k, v in rates.items() if v is not None}
            logs.update(kept)  # save/eval_seconds too (W&B)
            keep_in_log_history(state.log_history, state.global_step, kept)
            if state.is_world_process_zero:
                print(
                    format_step_line(
                        state.global_step, state.max_steps, logs["loss"], logs.get("learning_rate", 0.0), rates
                    ),
                    flush=True,
                )

        def on_train_end(self, args, state, control, **kwargs):
            m = self.meter
            end = m.snapshot()
            start, first, end = m.reduce([m.begin, m.first or end, end])
            m.totals = {"start": start, "first": first, "end": end}
            if m.steady_from > 1 and m.steps > m.steady_from and state.is_world_process_zero:
                print(
                    f"llmft: run_summary.json rates are over steps {m.steady_from + 1}-{m.steps} ({m.steady_why})",
                    flush=True,
                )

    return ThroughputCallback


def time_outside_training(meter: Meter, owner, name: str, kind: str) -> None:
    """Make `owner.name` (a bound method) count as non-training time of `kind`."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        with meter.outside_training(kind):
            return original(*args, **kwargs)

    setattr(owner, name, timed)


def attach(trainer, clock: StartupClock, gpu, reference: bool = False) -> Meter:
    """Meter a built trainer (SFTTrainer, DPOTrainer, ...): time and count the micro-batches
    Trainer.get_batch_samples pulls (a preference batch's input_ids hold chosen and rejected, or KTO's completions),
    time checkpoint saves (the save and the on_save callbacks that check and publish it) and evaluations as
    non-training time, and put the callback first so its metrics are in the logs before W&B's callback sends them.
    `reference`: the method has a reference model (llmft.planning.methods); its forward is counted unless TRL
    precomputed its log-probs."""
    live = reference and not getattr(trainer.args, "precompute_ref_log_probs", False)
    meter = Meter(flop_shape(trainer.model, live_reference=live), gpu, clock, trainer.args.world_size)
    time_outside_training(meter, trainer, "_save_checkpoint", "save")
    time_outside_training(meter, trainer.callback_handler, "on_save", "save")
    time_outside_training(meter, trainer, "evaluate", "eval")
    get_batch_samples = trainer.get_batch_samples

    def metered_get_batch_samples(epoch_iterator, num_batches, device):
        return get_batch_samples(meter.timed(epoch_iterator), num_batches, device)

    trainer.get_batch_samples = metered_get_batch_samples
    trainer.callback_handler.callbacks.insert(0, _callback_class()(meter))
    return meter


def perplexity(nll_sum: float, tokens: int) -> float | None:
    return math.exp(nll_sum / tokens) if tokens else None


def add_perplexity(logs: dict) -> dict:
    """eval_perplexity = exp(eval_loss) beside every evaluation loss the trainer logs."""
    if "eval_loss" in logs and "eval_perplexity" not in logs:
        logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 700.0))
    return logs


def log_perplexity(trainer) -> None:
    """Make the trainer log perplexity with every evaluation (in its log history, W&B and on rank 0's console)."""
    trainer_log = trainer.log

    def log(logs, *args, **kwargs):
        add_perplexity(logs)
        if "eval_loss" in logs and trainer.state.is_world_process_zero:
            print(
                f"llmft: step {trainer.state.global_step}/{trainer.state.max_steps} eval loss {logs['eval_loss']:.4f} "
                f"perplexity {logs['eval_perplexity']:.3f}",
                flush=True,
            )
        return trainer_log(logs, *args, **kwargs)

    trainer.log = log
