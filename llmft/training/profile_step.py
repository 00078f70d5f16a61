"""--profile_step N: where one optimizer step's time goes, from torch.profiler, written where the run is.

The GPU suite's MFU rows ask it (issue 45: "name what the profiler says the step spends its time on"); a user asks it
the same way. Rank 0 writes OUTPUT_DIR/profile_step_N.txt, the 10 entries with the most self time (on a GPU its
kernels, by device time; on CPU the operators, by CPU time) and their share of the step, and prints the first three:

    llmft: profiled step 3 (1.84 s): 31.2% sm90_xmma_gemm_bf16..., 12.0% flash_fwd..., 8.1% ...; all 10 in out/profile_step_3.txt

The profiler's overhead lands in that step, so the step and those before it are left out of run_summary.json's rates
(the meter's steady state starts after it, as it does after torch.compile's compiling steps).
"""

from __future__ import annotations

import time
from pathlib import Path

from llmft.planning.world import rank0

TOP = 10


def top_entries(averages, sort_key: str, n: int = TOP) -> list[tuple[str, float]]:
    """(name, self microseconds) of the n entries of torch.profiler's key_averages() with the most self time."""
    rows = [(e.key, float(getattr(e, sort_key, 0.0) or 0.0)) for e in averages]
    rows = [r for r in rows if r[1] > 0]
    return sorted(rows, key=lambda r: -r[1])[:n]


def format_table(step: int, wall_s: float, device: str, rows: list[tuple[str, float]], total_us: float) -> str:
    lines = [
        f"llmft --profile_step {step}: {wall_s:.3f} s wall; top {len(rows)} by self {device} time "
        f"(share of all self {device} time in the step)",
        "",
        f"{'share':>7}  {'ms':>10}  name",
    ]
    for name, us in rows:
        lines.append(f"{us / total_us:>7.1%}  {us / 1e3:>10.3f}  {name}")
    return "\n".join(lines) + "\n"


def callback(step: int, output_dir: str, meter):
    """A TrainerCallback profiling optimizer step `step` (lazily defined: transformers and torch are heavy)."""
    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sort_key, device = ("self_device_time_total", "GPU") if cuda else ("self_cpu_time_total", "CPU")

    class ProfileStep(TrainerCallback):
        def __init__(self):
            self.profiler, self.started = None, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                if cuda:
                    torch.cuda.synchronize()
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.profiler is None or state.global_step != step:
                return
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.started
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            self.profiler = None
            if rank0():
                everything = top_entries(averages, sort_key, n=len(averages))
                total = sum(us for _, us in everything) or 1.0
                rows = everything[:TOP]
                path = Path(output_dir) / f"profile_step_{step}.txt"
                path.write_text(format_table(step, wall, device, rows, total))
                head = ", ".join(f"{us / total:.1%} {name[:60]}" for name, us in rows[:3])
                print(f"llmft: profiled step {step} ({wall:.2f} s): {head}; all {len(rows)} in {path}", flush=True)
            meter.steady_after_this_step()  # the profiler's overhead stays out of the rates

    return ProfileStep()
