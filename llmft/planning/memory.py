"""Memory accounting for a fine-tuning run: will it fit these GPUs and hosts, and which setting should it use?

Pure functions of numbers: a `ModelShape` (what the model is), a `Job` (the hardware and the run's knobs) and a
`Setting` (ZeRO stage, offload, micro-batch, accumulation, gradient checkpointing). Nothing here imports torch or
deepspeed, so `llmft plan` answers on a login node; `llmft.planning.model_shape` builds the `ModelShape` from a config.

    shape = model_shape("runs/llama-config")                      # llmft.planning.model_shape: meta device, no weights
    job = Job(shape, gpu=GPUS["A100-40GB"], host_ram_gib=680, nnodes=1, nproc_per_node=8, max_length=2048,
              global_batch=64, precision="bf16")
    plan = plan_memory(job)                                       # every candidate, the recommended one first
    plan.recommended.setting, plan.recommended.gpu_total_gib, plan.recommended.why

Bytes throughout; reports in GiB (2**30). The accounting, term by term (P parameters, T of them trainable,
F = P - T frozen, N GPUs in the job, n per node, L the largest single module's own parameters, w the bytes of
the training precision: 2 for bf16/fp16, 4 for fp32):

Model states per GPU (`model_states_bytes`). Per trainable element, as DeepSpeed's estimator counts it: 2 bytes
16-bit parameter, 2 bytes 16-bit gradient, 4 bytes fp32 gradient, 4 bytes fp32 master parameter, 8 bytes Adam
moments (20 in all; the ZeRO paper's 16 = 2 + 2 + K=12 has no separate fp32 gradient). In fp32 the working
parameter and gradient are 4 bytes each and there is no fp32 gradient copy (DeepSpeed still clones the master).
    stage 0: 20 T                      (nothing partitioned; ZeRO paper's baseline with DeepSpeed's K=16)
    stage 1: 4 T + 16 T/N              (optimizer partitioned: ZeRO paper's P_os)
    stage 2: 2 T + 18 T/N              (+ gradients: DeepSpeed's estimate_zero2_model_states_mem_needs)
    stage 3: 4 L + 18 T/N              (+ parameters: estimate_zero3_model_states_mem_needs; 4 L = the largest
                                        layer gathered with its gradient)
    offload optimizer: stage 2: 2 T; stage 3: 4 L + 2 T/N; offload optimizer+params (stage 3): 4 L  (DeepSpeed)
  Frozen parameters (LoRA) keep only their w-byte weights: F w per GPU, or F w / N under ZeRO-3. With
  --load_in_4bit the frozen linear weights (all but the LM head) are NF4: 0.5 byte + an fp32 scale per 64 weights
  (bitsandbytes' default, no double quantization: TRL's default) = 0.5625 byte. Full fine-tuning (F = 0) agrees
  with DeepSpeed's own functions exactly; tests/test_memory.py checks that against them over a grid.

Activations per GPU (`activation_bytes`), for decoder layers of today's shape: pre-norm, RMSNorm or LayerNorm,
grouped-query attention through SDPA or flash attention (no s^2 score matrix is kept), SwiGLU (gate, up, down) or
a two-matrix GELU MLP. Per token and layer, what autograd saves (a = w bytes per element, h hidden, kv the K/V
width, I the MLP width):
    attention: norm 4h + a h (RMSNorm upcasts to fp32), q/k/v input a h, q a h, k and v a kv each (a h each with
               SDPA when a padding mask is present: transformers repeats the K/V heads), output a h, o_proj input a h
    SwiGLU MLP: norm 4h + a h, gate/up input a h, gate, SiLU, up and their product a I each (4 a I)
    GELU MLP:   norm a h, fc input a h, fc output and GELU output a I each (GPT-2's gelu_new is a chain of
               elementwise ops: 5 a I), plus 1-byte dropout masks (2 h) if dropout > 0
    LoRA:       frozen linear layers and RMSNorm weights keep no copy of their inputs (needed only for weight
               gradients): minus a (3h + I) and a h per RMSNorm; with dropout (TRL's default lora_dropout 0.05)
               each adapted linear keeps its own dropped-out input and mask: plus (a + 1) x its input width
               (`ModelShape.lora_inputs`: 6h + I for every linear of a SwiGLU layer, 2h for PEFT's default q/v).
               Measured on an H100 (bench/activations.py, TinyLlama's layer, r=16 on every linear): 113,512 bytes
               per token and layer against 113,152 counted; full fine-tuning 87,176 against 91,136.
  With full recomputation (gradient checkpointing on every decoder layer) each layer keeps only its input (a h per
  token) and one layer's activations are rebuilt at a time. SDPA with a padding mask adds the boolean mask
  (micro-batch x s^2 bytes, shared by all layers).

Long sequences (`activation_bytes`'s keywords; docs/long-context.md): under Ulysses (--sequence_parallel N) each
rank holds length / N tokens of a sample, and the attention after the all-to-all holds the whole sequence for 1/N of
the heads (the same bytes); Ulysses drops the mask, as does a micro-batch of one sample (no padding), so SDPA keeps
grouped K/V as they are and there is no length^2 term. --tiled_mlp (DeepSpeed's TiledMLP) keeps only the MLP's
input; its backward adds a full-size input gradient and one shard's MLP tensors (`tiled_mlp_backward_bytes`, one
shard per `hidden` tokens) and its forward runs once more (2 x the MLP's weights in FLOPs per token).
--activation_offloading with recomputation moves every layer's input to pinned host RAM
(`offloaded_activation_bytes`, each block rounded up to a power of two), keeping OFFLOAD_STASH of them on the GPU.
Ulysses' all-to-alls (`ulysses_bytes_per_layer`): per layer and pass, (N - 1)/N of each rank's q, k, v and attention
output; forward, backward and the recomputed forward; over NVLink/PCIe inside a node, the node's shared network
beyond it (llmft.planning.comm.ulysses_link), not hidden behind compute. Measured on CPU against the tensors
autograd saves on 1 and 2 Ulysses ranks at two lengths: within 5% (tests/test_long_context.py).

Loss buffers per GPU (`loss_buffer_bytes`): TRL's SFTTrainer computes the loss with a fused, chunked LM head
(trl.trainer.utils.add_fused_lm_head): the [tokens, vocabulary] logits are never materialised. It keeps a w-byte
tile of 4096 tokens x 32768 vocabulary columns, an fp32 gradient of the final hidden states (4 h per token), and,
when the LM head trains, an fp32 gradient of the whole LM head (4 V h, with its w-byte cast): 3 GiB for Llama-3's
128k vocabulary at hidden 4096, whatever the batch.

Preference tuning (`Job.method`, llmft.planning.methods; TRL 1.16's DPOTrainer._compute_loss): a pair's chosen and
rejected run through the policy in one forward, so activations and the loss head's buffers are counted for
micro-batch x the method's sequences_per_example sequences (2 for DPO, KTO and reward models), and tokens/s counts
every one of them. The reference (`Job.reference_strategy`, `reference_weight_bytes`):
    copy         a second, frozen copy of the weights (w P): TRL's prepare_deepspeed makes it a stage-0 replica under
                 ZeRO-0/1/2 and a ZeRO-3 inference engine under ZeRO-3 (w P / N);
    precomputed  --precompute_ref_log_probs: one reference pass before training writes the log-probs into the data,
                 so nothing of the reference is held while training;
    adapter      LoRA: the policy with its adapter disabled is the reference (no copy);
plus, when it runs live (copy or adapter), its forward's transient (`reference_forward_bytes`): TRL runs it under
no_grad after the policy's forward, while the policy's activations are held, so autograd keeps nothing and one layer's
tensors for the pair's sequences, the fused LM head's tile and the per-token log-probs are live at a time. Its forward
costs 2 P FLOPs per token more (`flops_per_token`'s reference_forward). A reward model's loss head is a one-output
score head (`score_head_bytes`: the [tokens, 1] scores and the hidden states' gradient, no vocabulary tile); its
model is counted with the LM head's weights (over by vocab x hidden where they are not tied to the embedding).

Not all at once (`optimizer_step_bytes`): ZeRO-1/2/3 in 16-bit training make the fp32 gradient partition (4 T/N, one
of the model states) and a flat copy of the 16-bit gradient partition (2 T/N) only in the optimizer step (ZeRO-3 one
sub-group at a time), after the activations and loss buffers are freed. The peak is the larger of the two phases:
model states - 4 T/N + activations + loss buffers while the micro-batches train, model states + 2 T/N in a ZeRO-1/2
step (`Estimate.phase` is the peak less the sum of the three columns). Measured on one GPU: 25.3 GiB planned for
25.4 with recomputation (the step), 49.5 for 48.6 without (the backward), where the sum said 27.9 and 54.1.

Liger's kernels (`Job.liger`: on by default on bf16 GPUs where liger-kernel is installed, llmft.planning.hardware.
choose_liger) keep fewer activations: LigerRMSNormFunction keeps its input and a fp32 1/rms per token (a h + 4
instead of 4 h + a h) and LigerSiLUMulFunction keeps gate and up but not SiLU's output (3 a I instead of 4 a I with
down's input). Measured on an H100 (TinyLlama's shape, micro-batch 4 x 2048, no recomputation): 4.4 GiB less under
ZeRO-2 and 4.7 under ZeRO-3; counted: 4.6.

Other per GPU (`zero_buffer_bytes` and fixed): DeepSpeed's working buffers, read from the ZeRO config (reduce
and all-gather buckets, the reduce bucket doubled with overlap_comm; under ZeRO-3 the prefetch bucket and the
gathered parameters it keeps live, up to stage3_max_live_parameters, beyond the largest layer), 1 GiB for the
CUDA context, cuBLAS workspace and NCCL buffers (not in torch.cuda.max_memory_allocated), and 10% of the
allocated total for allocator fragmentation.

Host RAM per node (`host_ram`): n processes' runtime (3 GiB each with CUDA: Python, torch, CUDA and NCCL host
allocations; 1 GiB on CPU), plus the larger of
    loading: ZeRO-0/1/2: transformers memory-maps the safetensors files, so a process whose checkpoint is
             already in the training precision holds no copy of its own (measured on CPU: +11 MiB for a 475 MiB
             model); one that converts (an fp32 checkpoint trained in bf16, or TRL's fp32 default on a bf16
             checkpoint) reads the stored tensors and holds the converted ones (P x (stored bytes + w); measured
             +720 MiB for 475 MiB fp32 -> bf16). ZeRO-3: zero.Init partitions while loading and rank 0 copies the
             mapped weights layer by layer, so a process holds about one layer (DeepSpeed's zero_init figure,
             4 L). The mapped file pages (P x the stored bytes, once per node) are page cache the kernel can
             reclaim: shown, not counted;
    training: offloaded optimizer states (16 T/N per process: fp32 master, fp32 gradient, moments), offloaded
             16-bit parameters (w P/N), and, on a CPU-only run, the processes' whole device memory;
             plus what saving a checkpoint adds: each process copies its largest optimizer tensor to the host
             for torch.save (4 T/N; under ZeRO-3 at most a sub-group, sub_group_size elements; nothing when
             already offloaded or on a CPU run), and under ZeRO-0/1/2 the first node also
             serialises the final model.safetensors (P w; the adapter, in every checkpoint, with LoRA). ZeRO-3 checkpoints are the ranks'
             shards only: nothing is gathered. The optional consolidated model at the end (--save_consolidated)
             needs P w on the first node, plus the same again while safetensors serialises it. With --async_save,
             the first node holds its ranks' checkpoint files in memory while a thread writes them
             (`async_save_bytes`; one checkpoint at a time, and never at the same time as a synchronous save).
  The ZeRO-3 loading and the offload terms carry DeepSpeed's additional_buffer_factor 1.5 (pinned buffers,
  fragmentation), which makes the ZeRO-3 offload figure equal DeepSpeed's zero_init estimate. DeepSpeed's ZeRO-2
  host figure (4 bytes x P per GPU, the optimizer not divided over nodes) assumes fp32 loading; llmft loads in
  the training precision, so it is not used.

Disk per checkpoint (`checkpoint_bytes`): the fp32 master weights and Adam moments of the trainable parameters
(12 T, over all ranks' files), the module weights in mp_rank_00_model_states.pt (ZeRO-0/1/2: T w) and, with
LoRA, the adapter (T w); llmft writes no model.safetensors into a checkpoint (llmft.training.checkpoint_save). Write time = size / the filesystem's write
bandwidth (stated; defaults: GCP Filestore BASIC_HDD 100 MB/s, AWS FSx for Lustre SCRATCH_2 at 1.2 TiB 240 MB/s);
it must fit, with the step in flight, inside the Slurm script's USR1 warning (--signal=B:USR1@120).

Throughput (`tokens_per_second`): FLOPs per token = 6 P (forward 2 P, backward 4 P; with LoRA the frozen weights
need no weight gradient: 4 P + 2 T) + 12 x layers x hidden x sequence (attention, PaLM's appendix B), plus another
forward (2 P) with recomputation; tokens/s = MFU x peak x GPUs / FLOPs per token, at a stated MFU (default 35%).
Communication (llmft.planning.comm, when the node type is known): the bytes each rank moves per optimizer step by ZeRO stage
(ZeRO-1 reduces gradients once per step, ZeRO-2/3 at every micro-batch, ZeRO-3 also gathers the parameters; LoRA
moves the adapters' gradients only), over the node's network or NVLink/PCIe inside one node; the step takes its
compute plus the communication DeepSpeed does not overlap with it (each micro-batch's reduction hides only behind
its own backward, its last bucket exposed; ZeRO-0/1's reduction and the all-gather after the step exposed), plus,
under CPU offload, the copies over each GPU's PCIe link to the host, and tokens/s follows. Not modelled: kernel-level
slowdowns (ZeRO-3 ran 2.8x slower than ZeRO-2 for a 1.1B model on one H100, bench/README.md) and the CPU optimizer
step, so ZeRO-3 and CPU offload rows are slower than they show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from llmft.errors import LlmftError
from llmft.planning import comm, methods
from llmft.planning.batch import BatchError, plan_batch
from llmft.planning.collective_timeout import SAVE_FACTOR, collective_timeout
from llmft.planning.final_save import FINAL_SAVE_FACTOR, FINAL_SAVE_MARGIN_S, final_save_lead
from llmft.planning.hardware import GPU
from llmft.planning.sequence_parallel import SequenceParallelError, check_model

GIB = 2**30
OFFLOADS = ("none", "optimizer", "optimizer+params")
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor
CUDA_CONTEXT_GIB = 1.0
FRAGMENTATION = 0.10
PROCESS_HOST_GIB = {"cuda": 3.0, "cpu": 1.0}
OFFLOAD_STASH = 5  # trl.models.activation_offloading: max_fwd_stash_size, activations kept on the GPU while copied
NF4_BYTES = 0.5 + 4 / 64  # 4-bit weight + fp32 absmax per block of 64
TRL_TOKEN_TILE, TRL_VOCAB_TILE = (
    4096,
    32768,
)  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE
PREEMPT_WINDOW_S = 120  # slurm/run_llm.slurm: #SBATCH --signal=B:USR1@120
ASYNC_SAVE_HINT_S = 60.0  # a periodic save that holds a GPU run this long is worth writing in the background
WRITE_MB_S = {"gcp": 100.0, "aws": 240.0, None: 100.0}  # Filestore BASIC_HDD 1 TiB; FSx Lustre SCRATCH_2 1.2 TiB
DEFAULT_MFU = 0.35
CHECKPOINT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
HF_MAX_SHARD_BYTES = 50 * 10**9  # PreTrainedModel.save_pretrained(max_shard_size="50GB")
REFERENCES = ("copy", "precomputed", "adapter")  # how a preference method's reference is held (Job.reference)


class MemoryPlanError(LlmftError, ValueError):
    """Numbers the planner cannot work with; the message says which and what to give instead."""


@dataclass(frozen=True)
class ModelShape:
    """What the accounting needs to know about a model; `llmft.planning.model_shape` reads it from a config."""

    name: str
    params: int  # unique parameters of the base model (tied embeddings once)
    largest_layer_params: int  # the largest single module's own parameters (DeepSpeed's model_to_params)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True  # SwiGLU (gate/up/down); False: two-matrix GELU MLP (GPT-2)
    rms_norm: bool = True
    dropout: bool = False  # residual/MLP dropout > 0 (GPT-2): 1-byte masks are kept
    checkpoint_dtype: str | None = None  # bf16 | fp16 | fp32: how the weights are stored (config.json); None unknown
    mlp_saved: int = 4  # MLP-wide tensors autograd keeps: SwiGLU 4; GELU 2 (fc output, activation); gelu_new 5
    quantizable_params: int = 0  # weights in linear layers other than the LM head (what bitsandbytes quantizes)
    lora_params: int = 0  # adapter parameters added by LoRA (0: full fine-tuning)
    lora_inputs: int = 0  # per decoder layer, the summed input widths of the linear layers LoRA adapts
    lora_mlp_inputs: int = 0  # the part of lora_inputs in the MLP (what --tiled_mlp recomputes instead of keeping)
    kv_heads_named: bool = (
        True  # the config names num_key_value_heads (DeepSpeed's Ulysses reads it; GPT-2's has none)
    )

    @property
    def lora(self) -> bool:
        return self.lora_params > 0

    @property
    def trainable(self) -> int:
        return self.lora_params if self.lora else self.params

    @property
    def frozen(self) -> int:
        return self.params if self.lora else 0

    @property
    def total(self) -> int:
        return self.params + self.lora_params

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Setting:
    """One way to run the job."""

    zero_stage: int
    offload: str  # none | optimizer | optimizer+params
    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    tiled_mlp: bool = False  # --tiled_mlp: DeepSpeed's TiledMLP (llmft.training.tiled_mlp)
    activation_offloading: bool = False  # --activation_offloading: TRL's, with gradient checkpointing (ALST's offload)
    precompute_ref_log_probs: bool = False  # the planner chose to precompute the reference (llmft.planning.preference)

    def describe(self) -> str:
        off = "" if self.offload == "none" else f", offload {self.offload}"
        gc = "on" if self.gradient_checkpointing else "off"
        extra = (
            (", tiled MLP" if self.tiled_mlp else "")
            + (", activations offloaded to the host" if self.activation_offloading else "")
            + (", reference log-probs precomputed" if self.precompute_ref_log_probs else "")
        )
        return (
            f"ZeRO-{self.zero_stage}{off}, micro-batch {self.micro_batch} x accumulation {self.grad_accum}, "
            f"gradient checkpointing {gc}{extra}"
        )

    def flags(self) -> list[str]:
        """The `llmft train` flags of the memory savers beyond ZeRO (tiling, offload)."""
        return (
            (["--tiled_mlp"] if self.tiled_mlp else [])
            + (["--activation_offloading", "true"] if self.activation_offloading else [])
            + (["--precompute_ref_log_probs", "true"] if self.precompute_ref_log_probs else [])
        )


@dataclass(frozen=True)
class Job:
    """The hardware and the run's knobs; everything the candidates are judged against."""

    shape: ModelShape
    gpu: GPU | None  # None: CPU processes (the device memory is host memory)
    host_ram_gib: float  # per node
    nnodes: int
    nproc_per_node: int
    max_length: int
    precision: str  # bf16 | fp16 | fp32
    global_batch: int | None = None
    micro_batch: int | None = None  # None: searched
    max_micro_batch: int | None = None  # the largest micro-batch the search may pick (llmft train --auto)
    grad_accum: int | None = None
    gpu_memory_gib: float | None = None  # default: gpu.memory_gib
    gradient_checkpointing: bool | None = None  # None: both tried; True/False: only that
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offloads: tuple[str, ...] = OFFLOADS
    load_in_4bit: bool = False
    attention: str = "sdpa"  # sdpa | flash_attention_2
    zero_config: dict = field(default_factory=dict)  # stage -> DeepSpeed zero_optimization section (buckets)
    save_total_limit: int | None = None
    free_disk_gib: float | None = None
    write_mb_s: float = WRITE_MB_S[None]
    mfu: float = DEFAULT_MFU
    preempt_window_s: float = PREEMPT_WINDOW_S
    save_consolidated: bool = False
    async_save: bool = False  # --async_save: each rank holds its checkpoint files' bytes while they are written
    network: comm.NodeNetwork | None = None  # the node type's links (llmft.planning.comm.NETWORKS); None: not modelled
    sequence_parallel: int = 1  # --sequence_parallel N: Ulysses groups of N ranks share each sample's sequence
    tiled_mlps: tuple[bool, ...] = (False,)  # --tiled_mlp off / on: which the candidates may use (off tried first)
    activation_offloads: tuple[bool, ...] = (False,)  # --activation_offloading off / on (GPUs, with recomputation)
    liger: bool = False  # Liger's RMSNorm/SwiGLU kernels run (llmft.planning.hardware.choose_liger): fewer activations
    method: str = methods.DEFAULT  # llmft train --method: its sequences per example, reference and loss head
    reference: str | None = None  # copy | precomputed | adapter (REFERENCES); None: the method's own default

    @property
    def method_entry(self) -> methods.Method:
        return methods.method(self.method)

    @property
    def sequences(self) -> int:
        """Sequences one example (the global batch's unit) puts through the policy's forward and backward."""
        return self.method_entry.sequences_per_example

    @property
    def reference_strategy(self) -> str:
        """How the method's frozen reference is held: 'none' for a method without one; as given; else the adapter
        disabled under LoRA (the base is the reference, TRL's default for a PEFT model) and a full copy otherwise."""
        if not self.method_entry.reference:
            return "none"
        if self.reference is not None:
            return self.reference
        return "adapter" if self.shape.lora else "copy"

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def data_parallel(self) -> int:
        """The ranks that train different samples: the global batch counts these (a sequence group shares one)."""
        return self.world // self.sequence_parallel

    @property
    def rank_length(self) -> int:
        """The tokens of one sample each rank holds: the sequence split over the Ulysses group (padded to N)."""
        return -(-self.max_length // self.sequence_parallel)

    @property
    def device_gib(self) -> float | None:
        if self.gpu is None:
            return None
        return self.gpu_memory_gib if self.gpu_memory_gib is not None else self.gpu.memory_gib


@dataclass(frozen=True)
class Estimate:
    """One candidate setting, costed."""

    setting: Setting
    model_states: int
    activations: int
    loss_buffers: int
    overhead: int
    host: dict[str, int]  # per node: runtime, loading, offload, saving, final, peak
    checkpoint: int  # bytes on disk per checkpoint
    write_s: float
    step_s: float | None
    tokens_per_s: float | None
    fits: bool
    why: str
    comm_bytes: float = 0.0  # per rank per optimizer step, on the wire (llmft.planning.comm.wire_bytes)
    time: comm.StepTime | None = None  # compute and communication of one step (None: no peak known)
    sequence_bytes: float = 0.0  # per rank per optimizer step, Ulysses' all-to-alls (sequence_parallel_bytes)
    phase: int = (
        0  # the peak less states + activations + loss buffers: they are not all live at once (`optimizer_step_bytes`)
    )
    reference: int = 0  # a preference method's reference: its weights and its live forward's transient

    @property
    def gpu_total(self) -> int:
        return self.model_states + self.activations + self.loss_buffers + self.reference + self.phase + self.overhead

    def as_dict(self) -> dict:
        s = self.setting
        return {
            "zero_stage": s.zero_stage,
            "offload": s.offload,
            "micro_batch": s.micro_batch,
            "grad_accum": s.grad_accum,
            "gradient_checkpointing": s.gradient_checkpointing,
            "tiled_mlp": s.tiled_mlp,
            "activation_offloading": s.activation_offloading,
            "model_states_gib": gib(self.model_states),
            "activations_gib": gib(self.activations),
            "loss_buffers_gib": gib(self.loss_buffers),
            "reference_gib": gib(self.reference),
            "overhead_gib": gib(self.overhead),
            "phase_gib": gib(self.phase),
            "gpu_total_gib": gib(self.gpu_total),
            "host_ram_gib_per_node": gib(self.host["peak"]),
            "host_ram_breakdown_gib": {k: gib(v) for k, v in self.host.items() if k != "peak"},
            "checkpoint_gib": gib(self.checkpoint),
            "checkpoint_write_s": round(self.write_s, 1),
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s),
            "comm_gib_per_step": gib(self.comm_bytes),
            "sequence_parallel_gib_per_step": gib(self.sequence_bytes),
            "sequence_parallel_s": None if self.time is None else round(self.time.sequence_s, 3),
            "step_s": None if self.time is None else round(self.time.step_s, 3),
            "comm_s": None if self.time is None else round(self.time.comm_s, 3),
            "exposed_comm_s": None if self.time is None else round(self.time.exposed_comm_s, 3),
            "offload_pcie_s": None if self.time is None else round(self.time.host_s, 3),
            "network_bound": None if self.time is None else self.time.network_bound,
            "fits": self.fits,
            "why": self.why,
        }


def gib(n: float) -> float:
    return round(n / GIB, 2)


# ---- DeepSpeed's estimators, reimplemented (deepspeed.runtime.zero.stage_1_and_2 / stage3, v0.19) ---------------
# Same arguments, same integer results; tests compare them with DeepSpeed's functions over a grid.


def ds_zero2_estimate(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5):
    """estimate_zero2_model_states_mem_needs: (host bytes per node, GPU bytes per GPU)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_zero3_estimate(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    cpu_offload=True,
    cpu_offload_params=True,
    zero_init=True,
    additional_buffer_factor=1.5,
):
    """estimate_zero3_model_states_mem_needs: (host bytes per node, GPU bytes per GPU, largest layer bytes)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            factor = 18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor)
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            factor = 16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor)
        cpu_mem = total_params * factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


# ---- per-GPU terms ------------------------------------------------------------------------------------------------


def element_bytes(precision: str) -> dict[str, int]:
    """Bytes per trainable element: working param, working grad, fp32 grad copy, fp32 master, Adam moments."""
    if precision in ("bf16", "fp16"):
        return {"w": 2, "g": 2, "g32": 4, "m32": 4, "opt": 8}
    if precision == "fp32":
        return {"w": 4, "g": 4, "g32": 0, "m32": 4, "opt": 8}
    raise MemoryPlanError(f"unknown precision {precision!r}; use bf16, fp16 or fp32")


def frozen_bytes(shape: ModelShape, precision: str, load_in_4bit: bool) -> float:
    """The frozen (LoRA base) weights: w bytes each, or NF4 for the linear layers under --load_in_4bit."""
    if not shape.lora:
        return 0
    w = element_bytes(precision)["w"]
    if not load_in_4bit:
        return shape.frozen * w
    quantized = min(shape.quantizable_params, shape.frozen)
    return quantized * NF4_BYTES + (shape.frozen - quantized) * w


def model_states_bytes(
    shape: ModelShape, zero_stage: int, offload: str, world: int, precision: str, load_in_4bit: bool = False
) -> int:
    """Parameters, gradients and optimizer states one GPU holds (the formulas in the module docstring)."""
    if offload not in OFFLOADS:
        raise MemoryPlanError(f"unknown offload {offload!r}; use one of {', '.join(OFFLOADS)}")
    if offload != "none" and zero_stage < 2 or offload == "optimizer+params" and zero_stage != 3:
        raise MemoryPlanError(f"offload {offload} is not available with ZeRO stage {zero_stage}")
    b = element_bytes(precision)
    T, N, L = shape.trainable, world, shape.largest_layer_params
    frozen = frozen_bytes(shape, precision, load_in_4bit)
    partitioned = b["g"] + b["g32"] + b["m32"] + b["opt"]  # 18 in 16-bit: DeepSpeed's multiplier
    if zero_stage == 0:
        return int((b["w"] + partitioned) * T + frozen)
    if zero_stage == 1:
        return int((b["w"] + b["g"]) * T + int((b["g32"] + b["m32"] + b["opt"]) * T / N) + frozen)
    if zero_stage == 2:
        if offload == "optimizer":
            return int(b["w"] * T + frozen)
        return int(b["w"] * T + int(partitioned * T / N) + frozen)
    if zero_stage == 3:
        gathered = 2 * b["w"] * L  # the largest layer gathered, with its gradient (DeepSpeed: 4 L in 16-bit)
        if offload == "optimizer+params":
            return int(gathered)
        if offload == "optimizer":
            return int(gathered + int(b["w"] * T / N) + int(frozen / N))
        return int(gathered + int(partitioned * T / N) + int(frozen / N))
    raise MemoryPlanError(f"unknown ZeRO stage {zero_stage!r}; use 0, 1, 2 or 3")


def optimizer_step_bytes(
    shape: ModelShape, zero_stage: int, offload: str, world: int, precision: str, zero_config: dict | None = None
) -> tuple[int, int]:
    """(absent while training, added in the step): the model states' bytes that exist only in the optimizer step,
    and what the step holds beyond the model states, per GPU. The peak is the larger of the two phases, not the sum.

    In 16-bit training DeepSpeed's ZeRO optimizers create the fp32 gradient partition (4 T/N, one of the model
    states' 18 T/N) only in the step, from a flat copy of the 16-bit gradient partition (2 T/N, counted nowhere
    else), and free both after the update: neither is live while the micro-batches' activations are. ZeRO-1/2
    (runtime/zero/stage_1_and_2.py, `step`) do the whole partition at once: (4 T/N, 2 T/N). ZeRO-3 (stage3.py,
    `_prepare_fp32_grad_for_sub_group`) one sub-group at a time, each freed before the next: (4 T/N, 6 S - 4 T/N),
    S the largest sub-group (sub_group_size elements at most). Measured on one GPU: the 1.24B Llama-3.2 shape under
    ZeRO-2 peaked at 25.4 GiB with recomputation (22 T = 25.3: the step) and 48.6 without (16 T + activations + loss
    buffers = 49.5: the backward), where counting all at once said 27.9 and 54.1. (0, 0) where the optimizer's fp32
    gradients live on the host (CPU offload), in fp32 training (no fp32 gradient copy) and under ZeRO-0, whose
    bf16 optimizer keeps fp32 gradients for accumulation."""
    b = element_bytes(precision)
    if zero_stage not in (1, 2, 3) or offload != "none" or not b["g32"]:
        return 0, 0
    partition = shape.trainable / world
    if zero_stage in (1, 2):
        return int(b["g32"] * partition), int(b["g"] * partition)
    value = (zero_config or {}).get("sub_group_size", 1_000_000_000)
    sub_group = min(partition, 1_000_000_000 if value == "auto" else int(value))
    return int(b["g32"] * partition), int((b["g32"] + b["g"]) * sub_group - b["g32"] * partition)


def layer_activation_bytes_per_token(
    shape: ModelShape,
    precision: str,
    attention: str = "sdpa",
    tiled_mlp: bool = False,
    masked: bool = True,
    liger: bool = False,
) -> int:
    """What autograd keeps for one decoder layer per token, without recomputation (module docstring). With
    --tiled_mlp the MLP keeps only its input (DeepSpeed's TiledMLP recomputes the rest in shards in the backward).
    `masked`: SDPA gets a padding mask, and transformers then repeats the K/V heads; without one (a micro-batch of
    one sample, or Ulysses, which drops the mask) SDPA takes grouped K/V as they are. `liger`: Liger's kernels
    replace RMSNorm and SwiGLU (`liger_kernels_apply`)."""
    a = element_bytes(precision)["w"]
    h, kv, inter = shape.hidden, shape.kv_width, shape.intermediate
    liger = liger and liger_kernels_apply(shape)
    norm = (4 * h + a * h) if shape.rms_norm and a < 4 else 2 * a * h if shape.rms_norm else a * h
    if liger:
        norm = a * h + 4  # LigerRMSNormFunction keeps its input and a fp32 1/rms per token, LoRA or not
    kv_saved = h if attention == "sdpa" and masked else kv
    attn = norm + a * h + a * h + 2 * a * kv_saved + a * h + a * h
    # the MLP's own tensors, beyond its input (a h); LigerSiLUMulFunction keeps gate and up, not SiLU's output
    mlp_inside = (shape.mlp_saved - (1 if liger else 0)) * a * inter
    mlp = norm + a * h + mlp_inside
    masks = 2 * h if shape.dropout else 0
    if not shape.lora:
        return attn + mlp + masks - (mlp_inside if tiled_mlp else 0)
    # LoRA: frozen linear layers and RMSNorm weights keep no copy of their inputs (those are only needed for weight
    # gradients): the inputs of q/k/v, o, the MLP's input projections and its output projection (3 h + I), and the
    # normalised input of each RMSNorm's weight. With TRL's default lora_dropout (0.05) each adapted linear keeps
    # its own dropped-out input (a bytes) and dropout mask instead (1 byte: CUDA's boolean mask; fp32, llmft's CPU
    # precision, keeps an fp32 mask there). Measured on an H100 for a TinyLlama layer with r=16 on every linear:
    # 113,512 bytes per token against 113,152 counted (bench/activations.py).
    frozen = a * (3 * h + inter) + (2 * a * h if shape.rms_norm and not liger else 0)
    mask = 1 if a < 4 else a
    full = attn + mlp + masks - frozen + (a + mask) * shape.lora_inputs
    if not tiled_mlp:
        return full
    # tiled: of the MLP only TiledMLP's saved input (a h) stays; its frozen-input savings and adapters' inputs go
    mlp_lora = mlp_inside - a * inter - a * h + (a + mask) * shape.lora_mlp_inputs  # a h: the frozen gate/up input
    return full - mlp_lora


def liger_kernels_apply(shape: ModelShape) -> bool:
    """Liger's layer kernels replace this shape's layers: RMSNorm and a SwiGLU MLP (Llama, Mistral, Qwen, ...)."""
    return shape.rms_norm and shape.gated_mlp


def tiled_mlp_shards(hidden: int, rank_length: int) -> int:
    """TiledMLP's shards per sample: one per `hidden` tokens on the rank (DeepSpeed's recipe; llmft.training.tiled_mlp
    runs this count, the largest over the ranks)."""
    return max(1, -(-rank_length // hidden))


def activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    seq: int,
    gradient_checkpointing: bool,
    precision: str,
    attention: str = "sdpa",
    *,
    sequence_parallel: int = 1,
    tiled_mlp: bool = False,
    activation_offloading: bool = False,
    liger: bool = False,
) -> int:
    """Activations kept for the backward pass on one GPU: every layer's, or with full recomputation every layer's
    input plus one layer rebuilt at a time; plus the final norm and, with SDPA, the shared padding mask.

    Under Ulysses (N > 1) each rank keeps its 1/N of the sequence (after the all-to-all a rank's attention holds the
    whole sequence for 1/N of the heads: the same bytes), and the mask is dropped (Ulysses runs causal attention
    without one). --tiled_mlp keeps only each MLP's input; its backward rebuilds one shard at a time beside a
    full-size input gradient. --activation_offloading (with recomputation) moves the layers' inputs to the host
    (`offloaded_activation_bytes`); TRL's offloader keeps up to OFFLOAD_STASH of them on the GPU while they copy."""
    a = element_bytes(precision)["w"]
    n = sequence_parallel
    rank_length = -(-seq // n)
    tokens = micro_batch * rank_length
    # a micro-batch of one sample has no padding, and transformers then runs SDPA causal without building a mask
    masked = attention == "sdpa" and n == 1 and micro_batch > 1
    per_layer = layer_activation_bytes_per_token(shape, precision, attention, tiled_mlp, masked, liger)
    final_norm = a * shape.hidden + 4 if liger and liger_kernels_apply(shape) else 4 * shape.hidden + a * shape.hidden
    head = final_norm + a * shape.hidden  # the final norm and the LM head's input
    mask = micro_batch * seq * seq if masked else 0
    if gradient_checkpointing:
        inputs = min(shape.layers, OFFLOAD_STASH) if activation_offloading else shape.layers
        kept = inputs * a * shape.hidden + per_layer
    else:
        kept = shape.layers * per_layer
    total = tokens * (kept + head) + mask
    if tiled_mlp:
        total += tiled_mlp_backward_bytes(shape, micro_batch, rank_length, precision)
    return total


def tiled_mlp_backward_bytes(shape: ModelShape, micro_batch: int, rank_length: int, precision: str) -> int:
    """What the backward of one tiled MLP adds while it runs: its input gradient (whole: TiledMLP fills it shard by
    shard) and one shard's MLP tensors, rebuilt with autograd."""
    a = element_bytes(precision)["w"]
    tokens = micro_batch * rank_length
    shard_tokens = micro_batch * -(-rank_length // tiled_mlp_shards(shape.hidden, rank_length))
    return tokens * a * shape.hidden + shard_tokens * (a * shape.hidden + shape.mlp_saved * a * shape.intermediate)


def offloaded_activation_bytes(shape: ModelShape, micro_batch: int, seq: int, precision: str, sequence_parallel: int):
    """Host RAM one process holds for --activation_offloading with recomputation: every decoder layer's input (the
    checkpoint's saved tensor) in pinned memory, whose allocator rounds each block up to a power of two (torch's
    CachingHostAllocator)."""
    a = element_bytes(precision)["w"]
    per_layer = micro_batch * -(-seq // sequence_parallel) * a * shape.hidden
    return shape.layers * (1 << max(0, math.ceil(math.log2(per_layer))))


def ulysses_bytes_per_layer(shape: ModelShape, micro_batch: int, seq: int, precision: str, sequence_parallel: int):
    """What one rank sends in Ulysses' all-to-alls for one decoder layer's forward: q, k and v to the head
    layout and the attention output back, (N - 1)/N of its share of each (the rest stays on the rank). The
    backward sends their gradients: the same again; recomputation repeats the forward's."""
    n = sequence_parallel
    if n == 1:
        return 0.0
    a = element_bytes(precision)["w"]
    tokens = micro_batch * -(-seq // n)
    return (n - 1) / n * tokens * a * (2 * shape.hidden + 2 * shape.kv_width)


def loss_buffer_bytes(shape: ModelShape, micro_batch: int, seq: int, precision: str) -> int:
    """TRL's fused, chunked LM head (the tiled loss: no [tokens, vocabulary] logits): a tile, the fp32 hidden-state
    gradient, and the fp32 LM-head gradient (only when the head trains: full fine-tuning). `seq`: the tokens of a
    sample on this rank (under Ulysses each rank's loss covers its part)."""
    a = element_bytes(precision)["w"]
    tokens = micro_batch * seq
    tile = a * min(tokens, TRL_TOKEN_TILE) * min(shape.vocab, TRL_VOCAB_TILE)
    grad_hidden = 4 * tokens * shape.hidden
    head_grad = 0 if shape.lora else (4 + a) * shape.vocab * shape.hidden
    per_token_stats = 6 * 4 * tokens  # log-sum-exp, log-probs, entropy ... (fp32 vectors)
    return tile + grad_hidden + head_grad + per_token_stats


def score_head_bytes(shape: ModelShape, micro_batch: int, seq: int, precision: str) -> int:
    """A reward model's loss head (AutoModelForSequenceClassification, num_labels=1): the score head runs over every
    token and the last one is pooled, so it keeps the [tokens, 1] scores and the final hidden states' gradient in the
    training precision, and the head's own (fp32 + w) gradient; no vocabulary tile."""
    a = element_bytes(precision)["w"]
    tokens = micro_batch * seq
    return tokens * (a + a * shape.hidden) + (4 + a) * shape.hidden


def loss_head_bytes(job: Job, micro_batch: int) -> int:
    """The method's loss head's buffers for a micro-batch of `micro_batch` examples: their sequences (chosen and
    rejected in one forward for a pair) through the LM head's fused loss, or a reward model's score head."""
    sequences = micro_batch * job.sequences
    if job.method_entry.loss_head == "score":
        return score_head_bytes(job.shape, sequences, job.rank_length, job.precision)
    return loss_buffer_bytes(job.shape, sequences, job.rank_length, job.precision)


def reference_weight_bytes(shape: ModelShape, strategy: str, zero_stage: int, world: int, precision: str) -> int:
    """The reference's own weights per GPU (module docstring): a copy is replicated under ZeRO-0/1/2 (a stage-0
    inference engine) and sharded over the world under ZeRO-3; precomputed log-probs and a disabled adapter hold
    none."""
    if strategy != "copy":
        return 0
    size = element_bytes(precision)["w"] * shape.params
    return -(-size // world) if zero_stage == 3 else size


def reference_forward_bytes(job: Job, setting: Setting) -> int:
    """What the reference's live forward holds beside the policy's activations (TRL runs it after the policy's
    forward, under no_grad and without recomputation): one decoder layer's tensors for the micro-batch's sequences,
    a layer's input and output, the fused LM head's tile and the fp32 per-token log-probs; under ZeRO-3 a sharded
    copy also gathers its largest layer. Nothing when the reference is precomputed or absent."""
    strategy = job.reference_strategy
    if strategy not in ("copy", "adapter"):
        return 0
    shape = job.shape
    a = element_bytes(job.precision)["w"]
    sequences = setting.micro_batch * job.sequences
    tokens = sequences * job.rank_length
    masked = job.attention == "sdpa" and job.sequence_parallel == 1 and sequences > 1
    layer = layer_activation_bytes_per_token(shape, job.precision, job.attention, False, masked, job.liger)
    tile = a * min(tokens, TRL_TOKEN_TILE) * min(shape.vocab, TRL_VOCAB_TILE)
    gathered = a * shape.largest_layer_params if strategy == "copy" and setting.zero_stage == 3 else 0
    return tokens * (layer + 2 * a * shape.hidden + 4) + tile + gathered


def zero_buffer_bytes(zero_stage: int, zero_config: dict, shape: ModelShape, precision: str) -> int:
    """DeepSpeed's working buffers beyond the model states, from its zero_optimization section (elements x w):
    the reduce and all-gather buckets (reduce doubled with overlap_comm); under ZeRO-3 the prefetch bucket, and
    the gathered parameters DeepSpeed keeps live between uses (up to stage3_max_live_parameters) beyond the
    largest layer the model-states term already counts."""
    w = element_bytes(precision)["w"]
    cfg = zero_config or {}
    hidden = shape.hidden

    def size(key, default):
        value = cfg.get(key, default)
        return default if value == "auto" else int(value)

    double = 2 if overlap_comm(zero_stage, cfg) else 1
    bucket = reduce_bucket_elements(zero_stage, cfg, hidden)
    if zero_stage in (0, 1):
        return w * bucket
    if zero_stage == 2:
        return w * (double * bucket + size("allgather_bucket_size", 500_000_000))
    live = max(0, min(shape.total, size("stage3_max_live_parameters", 1_000_000_000)) - shape.largest_layer_params)
    return w * (double * bucket + size("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)) + live)


def reduce_bucket_elements(zero_stage: int, zero_config: dict, hidden: int) -> int:
    """Gradient elements DeepSpeed reduces at a time: ZeRO-0 the engine's all-reduce bucket (allreduce_bucket_size,
    500M); ZeRO-1/2 reduce_bucket_size (DeepSpeed's default 500M); ZeRO-3 reduce_bucket_size, which "auto" makes
    hidden x hidden (transformers' DeepSpeed integration fills it so)."""
    if zero_stage == 0:
        return 500_000_000
    default = hidden * hidden if zero_stage == 3 else 500_000_000
    value = (zero_config or {}).get("reduce_bucket_size", default)
    return default if value == "auto" else int(value)


def overlap_comm(zero_stage: int, zero_config: dict) -> bool:
    """DeepSpeed's zero_optimization.overlap_comm: as configured, else on for ZeRO-3 only (DeepSpeedZeroConfig's
    default)."""
    return bool((zero_config or {}).get("overlap_comm", zero_stage == 3))


# ---- host, disk, time ---------------------------------------------------------------------------------------------


def checkpoint_bytes(shape: ModelShape, zero_stage: int, precision: str) -> int:
    """Bytes one checkpoint puts on disk, over all ranks (module docstring)."""
    w = element_bytes(precision)["w"]
    T = shape.trainable
    size = 12 * T  # fp32 master + Adam moments
    if zero_stage < 3:
        size += w * T  # mp_rank_00_model_states.pt (frozen weights excluded with LoRA)
        if shape.lora:
            size += (
                w * T
            )  # adapter_model.safetensors (a full model's weights are in the states file only: llmft.training.checkpoint_save)
    return size


def async_save_bytes(shape: ModelShape, zero_stage: int, precision: str, nproc_per_node: int, world: int) -> int:
    """Host RAM on the first node for --async_save checkpoints (llmft.training.checkpoint_async_save): the files its ranks write
    through DeepSpeed's checkpoint engine, snapshotted into host buffers (page-locked on a GPU, kept from the first
    background save until the first synchronous one): each rank's optimizer shard (12 T / N: the fp32 masters are
    ZeRO-3's weights too) and, under ZeRO-0/1/2, rank 0's module states (w T). A LoRA adapter is written by the
    Trainer itself, synchronously. One node: `checkpoint_bytes` of a full fine-tune."""
    w = element_bytes(precision)["w"]
    T = shape.trainable
    return int(12 * T / world * nproc_per_node + (0 if zero_stage == 3 else w * T))


def host_ram(job: Job, setting: Setting, device_bytes: int) -> dict[str, int]:
    """Host RAM per node, by phase (module docstring); 'peak' is what the node must have."""
    shape, n, N = job.shape, job.nproc_per_node, job.world
    b = element_bytes(job.precision)
    T, L = shape.trainable, shape.largest_layer_params
    runtime = n * PROCESS_HOST_GIB["cpu" if job.gpu is None else "cuda"] * GIB
    converts = shape.checkpoint_dtype != job.precision  # unknown dtype: assume a conversion
    if setting.zero_stage == 3:
        loading = 4 * L * n * BUFFER_FACTOR  # DeepSpeed's zero_init figure: about one layer per process
    elif converts:  # the stored tensors read, the converted ones kept (the base weights; LoRA adapters come after)
        loading = (CHECKPOINT_BYTES.get(shape.checkpoint_dtype, 4) + b["w"]) * shape.params * n
    else:
        loading = 0  # memory-mapped in place
    file_pages = shape.params * CHECKPOINT_BYTES.get(shape.checkpoint_dtype, 4)
    per_rank_offload = 0.0
    if setting.offload in ("optimizer", "optimizer+params"):
        per_rank_offload += (b["g32"] + b["m32"] + b["opt"]) * T / N
    if setting.offload == "optimizer+params":
        per_rank_offload += (b["w"] * T + frozen_bytes(shape, job.precision, job.load_in_4bit)) / N
    offload = per_rank_offload * n * BUFFER_FACTOR
    on_cpu = device_bytes * n if job.gpu is None else 0
    activations = 0
    if setting.activation_offloading:
        activations = n * offloaded_activation_bytes(
            shape, setting.micro_batch * job.sequences, job.max_length, job.precision, job.sequence_parallel
        )
    # Saving: each rank copies its largest optimizer tensor to the host for torch.save (already there if
    # offloaded, or on a CPU run); under ZeRO-0/1/2 rank 0 also serialises the final model.safetensors.
    saving = 0.0
    if setting.offload == "none" and job.gpu is not None:
        largest = T / (1 if setting.zero_stage == 0 else N)  # one flat fp32 tensor per rank (and param group)
        if setting.zero_stage == 3:  # ZeRO-3 splits it into sub-groups of sub_group_size elements
            sub_group = job.zero_config.get(3, {}).get("sub_group_size", 1_000_000_000)
            largest = min(largest, int(sub_group))
        saving += n * 4 * largest
    if setting.zero_stage < 3:
        saving += min(b["w"] * (T if shape.lora else shape.params), HF_MAX_SHARD_BYTES)
    final = 0.0
    if job.save_consolidated and setting.zero_stage == 3:
        model = b["w"] * (T if shape.lora else shape.total)
        final = model + min(model, HF_MAX_SHARD_BYTES)
    snapshot = async_save_bytes(shape, setting.zero_stage, job.precision, n, N) if job.async_save else 0
    training = (
        offload + activations + on_cpu + max(saving, snapshot, final)
    )  # a synchronous save first waits for the snapshot's writes
    return {
        "runtime": int(runtime),
        "loading": int(loading),
        "file_pages": int(file_pages),
        "offload": int(offload),
        "activations": int(activations),
        "device_on_host": int(on_cpu),
        "saving": int(saving),
        "async_save": int(snapshot),
        "final_model": int(final),
        "peak": int(runtime + max(loading, training)),
    }


def flops_per_token(
    shape: ModelShape, seq: int, gradient_checkpointing: bool, tiled_mlp: bool = False, reference_forward: bool = False
) -> float:
    """Model FLOPs per trained token (module docstring), recomputation included: with --tiled_mlp the MLPs' forward
    runs once more in the backward (2 x their weights); a live reference (a preference method's copy or disabled
    adapter) runs one more forward of the base weights and their attention (2 P + 4 x layers x hidden x sequence)."""
    P = shape.total
    dense = (4 * P + 2 * shape.trainable) if shape.lora else 6 * P
    if gradient_checkpointing:
        dense += 2 * P
    if tiled_mlp:
        dense += 2 * shape.layers * (3 if shape.gated_mlp else 2) * shape.hidden * shape.intermediate
    attention = 12 * shape.layers * shape.hidden * seq
    if reference_forward:
        dense += 2 * shape.params
        attention += 4 * shape.layers * shape.hidden * seq
    return dense + attention


def backward_share(
    shape: ModelShape, seq: int, gradient_checkpointing: bool, reference_forward: bool = False
) -> float:
    """The backward's share of a micro-batch's FLOPs (flops_per_token): everything but the forward (2 P, and a third
    of the attention's 12 x layers x hidden x sequence) and a live reference's forward; recomputation runs inside the
    backward."""
    forward = 2 * shape.total + 4 * shape.layers * shape.hidden * seq
    if reference_forward:
        forward += 2 * shape.params + 4 * shape.layers * shape.hidden * seq
    return 1 - forward / flops_per_token(shape, seq, gradient_checkpointing, reference_forward=reference_forward)


def live_reference(job: Job) -> bool:
    """The reference runs a forward every micro-batch (a copy, or the policy with its adapter disabled)."""
    return job.reference_strategy in ("copy", "adapter")


def step_time(job: Job, setting: Setting, compute_s: float) -> comm.StepTime:
    """One optimizer step on the job's links (llmft.planning.comm): compute, the communication it does not hide, and
    CPU offload's copies over PCIe."""
    shape = job.shape
    w = element_bytes(job.precision)["w"]
    frozen = frozen_bytes(shape, job.precision, job.load_in_4bit)
    msgs = comm.messages(
        setting.zero_stage,
        accumulation=setting.grad_accum,
        world=job.world,
        gradient_bytes=shape.trainable * w,
        param_bytes=shape.trainable * w,
        frozen_bytes=frozen,
        params=shape.total,
    )
    cfg = job.zero_config.get(setting.zero_stage, {})
    gathers = comm.gathers_per_micro_batch(shape.total)
    overlap = comm.Overlap(
        accumulation=setting.grad_accum,
        backward_share=backward_share(shape, job.max_length, setting.gradient_checkpointing, live_reference(job)),
        bucket_bytes=min(reduce_bucket_elements(setting.zero_stage, cfg, shape.hidden), shape.trainable) * w,
        overlap_comm=overlap_comm(setting.zero_stage, cfg),
        gathers=gathers,
    )
    host_s = 0.0
    if job.gpu is not None:
        host = comm.offload_host_bytes(
            setting.zero_stage,
            setting.offload,
            accumulation=setting.grad_accum,
            world=job.world,
            trainable=shape.trainable,
            w=w,
            frozen_bytes=frozen,
            gathers=gathers,
        )
        host_s = host / (comm.host_link_gbytes_s(job.gpu.name) * 1e9)
    return comm.step_time(
        setting.zero_stage,
        msgs,
        world=job.world,
        nnodes=job.nnodes,
        compute_s=compute_s,
        network=job.network,
        overlap=overlap,
        host_s=host_s,
    )


def tokens_per_second(job: Job, setting: Setting) -> float | None:
    if job.gpu is None or not job.gpu.peak_tflops:
        return None
    return (
        job.mfu
        * job.gpu.peak_tflops
        * 1e12
        * job.world
        / flops_per_token(
            job.shape, job.max_length, setting.gradient_checkpointing, setting.tiled_mlp, live_reference(job)
        )
    )


# ---- candidates -----------------------------------------------------------------------------------------------------


def estimate(job: Job, setting: Setting) -> Estimate:
    """Cost one setting against the job's hardware; `fits` and `why` say whether and which limit breaks."""
    shape = job.shape
    states = model_states_bytes(shape, setting.zero_stage, setting.offload, job.world, job.precision, job.load_in_4bit)
    acts = activation_bytes(
        shape,
        setting.micro_batch * job.sequences,
        job.max_length,
        setting.gradient_checkpointing,
        job.precision,
        job.attention,
        sequence_parallel=job.sequence_parallel,
        tiled_mlp=setting.tiled_mlp,
        activation_offloading=setting.activation_offloading,
        liger=job.liger,
    )
    loss = loss_head_bytes(job, setting.micro_batch)
    ref_weights = reference_weight_bytes(shape, job.reference_strategy, setting.zero_stage, job.world, job.precision)
    reference = ref_weights + reference_forward_bytes(job, setting)
    buckets = zero_buffer_bytes(setting.zero_stage, job.zero_config.get(setting.zero_stage, {}), shape, job.precision)
    absent, added = optimizer_step_bytes(
        shape, setting.zero_stage, setting.offload, job.world, job.precision, job.zero_config.get(setting.zero_stage)
    )
    training = states - absent + acts + loss + reference  # the micro-batches' forward and backward
    step = states + added + ref_weights  # the optimizer step, after the activations and loss buffers are freed
    peak = max(training, step)
    phase = peak - (states + acts + loss + reference)
    allocated = peak + buckets
    overhead = buckets + int(FRAGMENTATION * allocated) + (int(CUDA_CONTEXT_GIB * GIB) if job.gpu is not None else 0)
    device = peak + overhead
    host = host_ram(job, setting, device)
    ckpt = checkpoint_bytes(shape, setting.zero_stage, job.precision)
    write_s = ckpt / (job.write_mb_s * 1e6)
    tps = tokens_per_second(job, setting)
    w = element_bytes(job.precision)["w"]
    msgs = comm.messages(
        setting.zero_stage,
        accumulation=setting.grad_accum,
        world=job.world,
        gradient_bytes=shape.trainable * w,
        param_bytes=shape.trainable * w,
        frozen_bytes=frozen_bytes(shape, job.precision, job.load_in_4bit),
        params=shape.total,
    )
    wire = comm.wire_bytes(setting.zero_stage, msgs, job.world)
    sequence = sequence_parallel_bytes(job, setting)
    step_s, time = None, None
    if tps:
        tokens = setting.micro_batch * job.sequences * setting.grad_accum * job.data_parallel * job.max_length
        time = step_time(job, setting, tokens / tps)
        if sequence and job.network is not None:
            bytes_s, _ = comm.ulysses_link(job.network, job.sequence_parallel, job.nproc_per_node)
            time = replace(time, sequence_s=sequence / bytes_s)
        step_s, tps = time.step_s, tokens / time.step_s

    problems = []
    limit = job.device_gib
    if limit is not None and device > limit * GIB:
        problems.append(f"GPU memory: needs {gib(device)} GiB of {limit:g}")
    if host["peak"] > job.host_ram_gib * GIB:
        names = {
            "loading": "loading the weights",
            "offload": "offloaded states",
            "activations": "offloaded activations",
            "device_on_host": "the processes' tensors",
            "saving": "saving a checkpoint",
            "async_save": "--async_save's checkpoint in memory",
            "final_model": "the consolidated model",
        }
        worst = max(names, key=lambda k: host[k])
        problems.append(
            f"host RAM: needs {gib(host['peak'])} GiB per node of {job.host_ram_gib:g} "
            f"({names[worst]}: {gib(host[worst])} GiB)"
        )
    fits = not problems
    why = "; ".join(problems) if problems else "fits"
    return Estimate(
        setting,
        states,
        acts,
        loss,
        overhead,
        host,
        ckpt,
        write_s,
        step_s,
        tps,
        fits,
        why,
        wire,
        time,
        sequence,
        phase,
        reference,
    )


def sequence_parallel_bytes(job: Job, setting: Setting) -> float:
    """What one rank sends in Ulysses' all-to-alls per optimizer step: every layer's forward and backward (and the
    recomputed forward with gradient checkpointing), for each micro-batch."""
    per_layer = ulysses_bytes_per_layer(
        job.shape, setting.micro_batch, job.max_length, job.precision, job.sequence_parallel
    )
    passes = 3 if setting.gradient_checkpointing else 2
    return per_layer * job.shape.layers * passes * setting.grad_accum


def micro_batch_choices(job: Job) -> list[int]:
    """The micro-batches to try: the one asked for, else every one that keeps the global batch (largest first)."""
    if job.micro_batch is not None:
        return [job.micro_batch]
    if job.global_batch is not None:
        if job.global_batch % job.data_parallel:
            return []
        per_rank = job.global_batch // job.data_parallel
        choices = [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
    else:
        choices = [64, 32, 16, 8, 4, 2, 1]
    return [m for m in choices if job.max_micro_batch is None or m <= job.max_micro_batch]


def _accum(job: Job, micro: int) -> int:
    if job.global_batch is not None:
        return job.global_batch // (micro * job.data_parallel)
    return job.grad_accum or 1


def combinations(job: Job):
    """(stage, offload, gradient checkpointing, tiled MLP, activation offloading) the job allows, in llmft's order
    of preference (PREFERENCE)."""
    savers = [
        (gc, tiled, acts)
        for gc, tiled, acts in MEMORY_SAVERS
        if (job.gradient_checkpointing is None or gc == job.gradient_checkpointing)
        and tiled in job.tiled_mlps
        and acts in job.activation_offloads
    ]
    for offload in job.offloads:
        if offload != "none" and job.gpu is None:
            continue  # offloading to the CPU from the CPU: nothing to gain
        for stages in ((2, 1, 0), (3,)):  # ZeRO-3 last, after recomputation (PREFERENCE)
            for gc, tiled, acts in savers:
                for stage in stages:
                    if stage not in job.zero_stages:
                        continue
                    if offload == "optimizer" and stage < 2 or offload == "optimizer+params" and stage != 3:
                        continue
                    if stage == 3 and job.load_in_4bit:
                        continue  # 4-bit weights are not partitioned by ZeRO-3 in llmft's loading path
                    yield stage, offload, gc, tiled, acts


# (gradient checkpointing, tiled MLP, activation offloading), cheapest first: recomputation costs a forward (+33%),
# the tiled MLP another MLP forward (its shards run again in the backward), and offloading the layers' inputs their
# copies over PCIe; offloading is ALST's activation-checkpoint offload, so only with recomputation
MEMORY_SAVERS = (
    (False, False, False),
    (True, False, False),
    (False, True, False),
    (True, True, False),
    (True, True, True),
)


PREFERENCE = (
    "no CPU offload before offloading (the CPU optimizer step and PCIe traffic slow each step), "
    "ZeRO-2, 1, 0 before 3, even with recomputation (ZeRO-3 moves 1.5x the data of plain data parallelism and gathers "
    "every layer's weights each micro-batch: on an H100 a 1.1B model trained 2.0x faster under ZeRO-2 with "
    "gradient checkpointing than under ZeRO-3 without, bench/README.md), "
    "no recomputation before gradient checkpointing (+33% compute), "
    "then the largest micro-batch that fits"
)


@dataclass(frozen=True)
class MemoryPlan:
    job: Job
    candidates: list[Estimate]  # one per (stage, offload, checkpointing): its largest fitting micro-batch
    recommended: Estimate | None
    reason: str
    warnings: list[str]


def plan_memory(job: Job) -> MemoryPlan:
    """Every (stage, offload, checkpointing) with its largest fitting micro-batch; the first fitting one in llmft's
    order of preference (PREFERENCE) is recommended."""
    _check_job(job)
    micros = micro_batch_choices(job)
    if not micros:
        raise MemoryPlanError(
            f"global batch {job.global_batch} is not divisible by the data-parallel size {job.data_parallel}; "
            f"use a multiple of {job.data_parallel}"
        )
    candidates = []
    for stage, offload, gc, tiled, acts in combinations(job):
        best = None
        for micro in micros:  # largest first: the first that fits is the one to show
            est = estimate(job, Setting(stage, offload, micro, _accum(job, micro), gc, tiled, acts))
            if est.fits:
                best = est
                break
            best = best or est  # nothing fits: show the smallest memory (tried last) below
        if best is not None and not best.fits:
            best = estimate(job, Setting(stage, offload, micros[-1], _accum(job, micros[-1]), gc, tiled, acts))
        candidates.append(best)
    fitting = [c for c in candidates if c.fits]
    recommended = fitting[0] if fitting else None
    zero1 = _zero1_instead(recommended, fitting) if recommended is not None else None
    if zero1 is not None:
        fitting = [zero1] + [c for c in fitting if c is not zero1]
        recommended = zero1
    if recommended is not None:
        recommended = replace(recommended, why=_reason(recommended, candidates))
        candidates = [recommended] + [c for c in candidates if c is not fitting[0]]
        reason = recommended.why
    else:
        reason = "nothing fits: " + _closest(candidates)
    return MemoryPlan(job, candidates, recommended, reason, _warnings(job, recommended))


@dataclass(frozen=True)
class LongContextPlan:
    """`llmft plan --max_length L`'s answer to what L tokens take on these nodes: the plan with the smallest
    sequence parallelism that fits (its tiling and offload chosen by plan_with_savers), with a line for each smaller
    N saying what breaks; when nothing fits, the plan as asked and a line for each larger N tried."""

    plan: MemoryPlan
    tried: list[str]  # "--sequence_parallel 2: the closest, ..., breaks ..." for each other N tried


def plan_with_savers(job: Job) -> MemoryPlan:
    """The plan without tiling or activation offload, unless they are what fits, or what lets ZeRO-0/1/2 without CPU
    offload fit where the plan without them needs ZeRO-3 or CPU offload (slower than tiling's extra MLP forward:
    ZeRO-3 ran 2.8x slower than ZeRO-2 on one H100, bench/README.md). Then the plan with the ones the job allows,
    its table with their rows."""
    plain = replace(job, tiled_mlps=(False,), activation_offloads=(False,))
    if plain == job or False not in job.tiled_mlps or False not in job.activation_offloads:
        return plan_memory(job)
    first = plan_memory(plain)
    fast = first.recommended is not None and (
        first.recommended.setting.zero_stage < 3 and first.recommended.setting.offload == "none"
    )
    if fast:
        return first
    full = plan_memory(job)
    chosen = full.recommended
    if chosen is not None and (chosen.setting.tiled_mlp or chosen.setting.activation_offloading):
        return full
    return first


def sequence_parallel_choices(job: Job) -> list[int]:
    """The N a job can use: divisors of the world size, from 1 up, that the model's heads allow (DeepSpeed's rule)
    and that leave a global batch divisible by the data-parallel size."""
    out = []
    for n in range(1, job.world + 1):
        if job.world % n:
            continue
        try:
            kv = job.shape.kv_heads if job.shape.kv_heads_named else None
            check_model(n, job.shape.name, job.shape.heads, kv)
        except SequenceParallelError:
            continue
        if job.global_batch is not None and job.global_batch % (job.world // n):
            continue
        out.append(n)
    return out


def plan_long_context(job: Job, search_sequence_parallel: bool = True) -> LongContextPlan:
    """The first plan that fits, trying N = 1, 2, ... (each first without, then with the tiling and offload the job
    allows); when none does, the job's own plan without them, and each N's closest candidate with them. With
    `search_sequence_parallel` False the job's own N is the only one."""
    first = plan_with_savers(job)
    if first.recommended is not None:
        return LongContextPlan(first, [])
    tried = [(job.sequence_parallel, first)]
    if search_sequence_parallel:
        for n in sequence_parallel_choices(job):
            if n == job.sequence_parallel:
                continue
            mplan = plan_with_savers(replace(job, sequence_parallel=n))
            if mplan.recommended is not None:
                return LongContextPlan(mplan, [_tried_line(m, p) for m, p in tried if m < n])
            tried.append((n, mplan))
    plain = replace(job, tiled_mlps=(False,), activation_offloads=(False,))
    shown = plan_memory(plain) if plain != job else first
    if shown is first and len(tried) == 1:  # its one line would repeat the plan's own "nothing fits"
        return LongContextPlan(shown, [])
    return LongContextPlan(shown, [_tried_line(m, p) for m, p in tried])


def _tried_line(n: int, mplan: MemoryPlan) -> str:
    return f"--sequence_parallel {n}: {_closest(mplan.candidates)}"


def _zero1_instead(zero2: Estimate, fitting: list[Estimate]) -> Estimate | None:
    """The ZeRO-1 candidate to recommend instead of this ZeRO-2 one, or None. With accumulation above 1 ZeRO-1 reduces
    the gradients once per step where ZeRO-2 reduces them after every micro-batch's backward, its last bucket exposed
    each time (llmft.planning.comm), so it moves less and waits less: taken when it fits with the same offload and
    recomputation and its modelled step is no slower (without a modelled time, on the bytes alone). Where the
    backward hides ZeRO-2's reductions and ZeRO-1's single one is exposed whole (a large model on NVLink), ZeRO-2 can
    model faster, and stays."""
    s = zero2.setting
    if s.zero_stage != 2 or s.grad_accum <= 1:
        return None
    for c in fitting:
        o = c.setting
        if o.zero_stage == 1 and replace(o, zero_stage=2, micro_batch=s.micro_batch, grad_accum=s.grad_accum) == s:
            if c.tokens_per_s is None or zero2.tokens_per_s is None or c.tokens_per_s >= zero2.tokens_per_s:
                return c
            return None
    return None


def _reason(chosen: Estimate, candidates: list[Estimate]) -> str:
    """Why this one: for each way it is slower than the ideal, the evidence that the faster way does not fit."""
    s = chosen.setting

    def blocked(pred) -> str:
        others = [c for c in candidates if pred(c.setting)]
        if not others:
            return "not tried"
        best = min(others, key=lambda c: c.gpu_total + c.host["peak"])
        offload = "without offload" if best.setting.offload == "none" else f"offloading the {best.setting.offload}"
        savers = (", tiled MLP" if best.setting.tiled_mlp else "") + (
            ", activations offloaded" if best.setting.activation_offloading else ""
        )
        return (
            f"ZeRO-{best.setting.zero_stage} {offload}, checkpointing "
            f"{'on' if best.setting.gradient_checkpointing else 'off'}{savers}: {best.why}"
        )

    parts = []
    if s.offload == "none":
        parts.append("no CPU offload needed")
    else:
        parts.append(
            f"CPU offload ({s.offload}) because nothing fits without it (closest: "
            f"{blocked(lambda o: o.offload == 'none')})"
        )
    if s.gradient_checkpointing:
        same = lambda o: o.offload == s.offload and o.zero_stage == s.zero_stage and not o.gradient_checkpointing  # noqa: E731
        if any(same(c.setting) for c in candidates):
            parts.append(f"gradient checkpointing because without it no micro-batch fits ({blocked(same)})")
            if s.zero_stage < 3 and any(
                c.fits
                and c.setting.zero_stage == 3
                and c.setting.offload == s.offload
                and not c.setting.gradient_checkpointing
                for c in candidates
            ):
                parts.append("ZeRO-3 without it would fit but trains slower (2x on an H100, bench/README.md)")
        else:
            parts.append("gradient checkpointing as asked")
    else:
        parts.append("no recomputation needed")
    if s.zero_stage == 3:
        lower = [c for c in candidates if c.setting.zero_stage < 3]
        tried_recompute = any(c.setting.gradient_checkpointing for c in lower)
        parts.append(
            (
                "ZeRO-3 because ZeRO-0/1/2 do not fit"
                + (", even with gradient checkpointing" if tried_recompute else "")
            )
            if lower
            else "ZeRO-3"
        )
    elif s.zero_stage == 1 and s.grad_accum > 1:
        zero2 = [
            c
            for c in candidates
            if c.setting.zero_stage == 2
            and c.setting.offload == s.offload
            and c.setting.gradient_checkpointing == s.gradient_checkpointing
        ]
        timed = (
            f": {chosen.step_s:.1f} s a step against ZeRO-2's {zero2[0].step_s:.1f} s"
            if zero2 and chosen.time is not None and zero2[0].time is not None and chosen.time.comm_s > 0
            else ""
        )
        parts.append(
            f"ZeRO-1 reduces gradients once per step (ZeRO-2: at each of the {s.grad_accum} micro-batches){timed}"
        )
    else:
        parts.append(f"ZeRO-{s.zero_stage} moves no more data than plain data parallelism (ZeRO-3: 1.5x)")
    if s.tiled_mlp:
        parts.append(
            "tiled MLP because the sequence does not fit without it (closest: "
            f"{blocked(lambda o: o.offload == s.offload and not o.tiled_mlp)})"
        )
    if s.activation_offloading:
        parts.append(
            "activations offloaded to the host because the sequence does not fit on the GPU otherwise (closest: "
            f"{blocked(lambda o: o.offload == s.offload and not o.activation_offloading)})"
        )
    parts.append(f"micro-batch {s.micro_batch} is the largest that fits")
    return "; ".join(parts)


def _closest(candidates: list[Estimate]) -> str:
    if not candidates:
        return "no setting was possible"
    best = min(candidates, key=lambda c: c.gpu_total + c.host["peak"])
    return f"the closest, {best.setting.describe()}, breaks {best.why}"


def _warnings(job: Job, chosen: Estimate | None) -> list[str]:
    out = []
    if chosen is None:
        return out
    if job.free_disk_gib is not None and job.save_total_limit:
        # llmft deletes the oldest only once the next is complete: limit + 1 checkpoints at once (llmft.checkpoint.run_dir.rotate)
        need = (job.save_total_limit + 1) * chosen.checkpoint
        if need > job.free_disk_gib * GIB:
            out.append(
                f"save_total_limit {job.save_total_limit} keeps {job.save_total_limit} complete checkpoints while writing the "
                f"next: {job.save_total_limit + 1} x {gib(chosen.checkpoint)} GiB per checkpoint = {gib(need)} GiB "
                f"exceeds the {job.free_disk_gib:.1f} GiB free in the output directory; lower --save_total_limit or free space"
            )
    elif job.free_disk_gib is not None and chosen.checkpoint > job.free_disk_gib * GIB:
        out.append(
            f"one checkpoint ({gib(chosen.checkpoint)} GiB) exceeds the {job.free_disk_gib:.1f} GiB free in the output directory"
        )
    if job.free_disk_gib is not None and not job.save_total_limit:
        out.append(
            "--save_total_limit is not set: every checkpoint is kept "
            f"({gib(chosen.checkpoint)} GiB each, {job.free_disk_gib:.1f} GiB free)"
        )
    t = chosen.time
    if t is not None and t.network_bound:
        out.append(
            f"the network decides this job's speed: each GPU moves {gib(chosen.comm_bytes)} GiB per step over the {t.link} "
            f"({t.comm_s:.1f} s, {t.exposed_comm_s:.1f} s not hidden) against {t.compute_s:.1f} s of compute; what helps: "
            "fewer, larger nodes (NVLink or PCIe inside a node), LoRA (only the adapters' gradients move), a larger "
            "micro-batch (fewer gradient reductions per step under ZeRO-2/3)"
        )
    if job.gpu is not None and not job.async_save and chosen.write_s >= ASYNC_SAVE_HINT_S:
        with_async = estimate(replace(job, async_save=True), chosen.setting).host
        room = (
            f"this node's {job.host_ram_gib:g} GiB has room for it"
            if with_async["peak"] <= job.host_ram_gib * GIB
            else f"more than this node's {job.host_ram_gib:g} GiB can spare"
        )
        out.append(
            f"each periodic checkpoint holds training for its whole write ({chosen.write_s:.0f} s at "
            f"{job.write_mb_s:g} MB/s); --async_save writes it in the background (on an H100 a 15 GB checkpoint held "
            f"training 0.3 s instead of 21 s: bench/README.md) for {gib(with_async['async_save'])} GiB of host RAM on "
            f"the first node, kept while the run lasts: {room}"
        )
    final_save = _final_save_warning(job, chosen)
    if final_save is not None:
        out.append(final_save)
    return out


def _final_save_warning(job: Job, chosen: Estimate) -> str | None:
    """The warning that a save outlasts the USR1 warning, with the lead the run will stop at (None when it fits).

    The lead is llmft.training.job_deadline's own (`final_save_lead`): under --async_save the final save, and a stop
    save, first wait out a background write that may have just begun, so two saves count, and a plan that counted one
    would state half of what the run does."""
    saves = 2 if job.async_save else 1
    if saves * chosen.write_s + (chosen.step_s or 0) <= job.preempt_window_s:
        return None
    lead = final_save_lead(None, chosen.write_s, chosen.step_s or 0, async_save=job.async_save)
    in_flight = " x 2" if job.async_save else ""
    return (
        f"a checkpoint ({gib(chosen.checkpoint)} GiB) takes {chosen.write_s:.0f} s to write at {job.write_mb_s:g} MB/s"
        + (", and a final or stop save first waits out a background write in flight" if job.async_save else "")
        + (f" after a {chosen.step_s:.0f} s step" if chosen.step_s else "")
        + f": more than the {job.preempt_window_s:g} s the Slurm script's USR1 warning leaves before the time limit; "
        f"a Slurm run stops for its final save {lead:.0f} s ({lead / 60:.0f} min) before the time limit instead "
        f"({FINAL_SAVE_FACTOR:g} x {chosen.write_s:.0f} s{in_flight} + the step + {FINAL_SAVE_MARGIN_S:.0f} s; after its "
        f"first save, {FINAL_SAVE_FACTOR:g} x the longest it measured{' x 2' if job.async_save else ''}), and trains that "
        "much less per job (faster storage, or LoRA, shortens it); a dead node stops the job after at most "
        f"{collective_timeout(chosen.step_s or 0.0, chosen.write_s)[0]:.0f} s (the collective timeout, never shorter "
        f"than {SAVE_FACTOR:g} x a save)"
    )


def _check_job(job: Job) -> None:
    for name, value in (
        ("nnodes", job.nnodes),
        ("nproc_per_node", job.nproc_per_node),
        ("max_length", job.max_length),
    ):
        if not isinstance(value, int) or value < 1:
            raise MemoryPlanError(f"--{name} must be a positive integer, got {value!r}")
    for name, value in (("global_batch_size", job.global_batch), ("per_device_train_batch_size", job.micro_batch)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise MemoryPlanError(f"--{name} must be a positive integer, got {value!r}")
    if job.global_batch is not None and job.micro_batch is not None:
        try:  # the same arithmetic, and the same message with the nearest batches that work, as the batch-only plan
            plan_batch(job.data_parallel, job.micro_batch, job.global_batch, job.grad_accum)
        except BatchError as e:
            raise MemoryPlanError(str(e)) from None
    elif job.global_batch is not None and job.global_batch % job.data_parallel:
        size = "world size" if job.sequence_parallel == 1 else "data-parallel size"
        raise MemoryPlanError(
            f"global batch {job.global_batch} is not divisible by the {size} {job.data_parallel}: "
            f"use a multiple of {job.data_parallel}"
        )
    if job.sequence_parallel < 1 or job.world % job.sequence_parallel:
        raise MemoryPlanError(
            f"--sequence_parallel {job.sequence_parallel} does not divide the world size {job.world}: use a divisor"
        )
    if True in job.activation_offloads and job.gpu is None:
        raise MemoryPlanError(
            "--activation_offloading moves activations from GPU memory to the host; CPU processes hold them in host "
            "memory already: drop it"
        )
    if job.host_ram_gib <= 0 or not math.isfinite(job.host_ram_gib):
        raise MemoryPlanError(f"host RAM must be a positive number of GiB, got {job.host_ram_gib!r}")
    if job.device_gib is not None and (job.device_gib <= 0 or not math.isfinite(job.device_gib)):
        raise MemoryPlanError(f"GPU memory must be a positive number of GiB, got {job.device_gib!r}")
    if not 0 < job.mfu <= 1:
        raise MemoryPlanError(f"--mfu must be in (0, 1], got {job.mfu!r}")
    if job.write_mb_s <= 0:
        raise MemoryPlanError(f"--write_mb_s must be positive, got {job.write_mb_s!r}")
    if job.load_in_4bit and not job.shape.lora:
        raise MemoryPlanError("--load_in_4bit trains LoRA adapters on frozen 4-bit weights: add --use_peft")
    if job.load_in_4bit and (job.gpu is None or not job.gpu.bitsandbytes_4bit):
        where = "a CPU" if job.gpu is None else f"a {job.gpu.name}"
        raise MemoryPlanError(
            f"--load_in_4bit needs bitsandbytes' 4-bit kernels (compute capability 7.5+), not {where}"
        )
    if job.save_consolidated and job.shape.lora:
        raise MemoryPlanError("--save_consolidated gathers a full ZeRO-3 model; a LoRA run saves its adapter instead")
    if job.attention not in ("sdpa", "flash_attention_2"):
        raise MemoryPlanError(f"unknown attention {job.attention!r}; use sdpa or flash_attention_2")
    element_bytes(job.precision)
    _check_reference(job)


def _check_reference(job: Job) -> None:
    """The method is one llmft knows, and its reference a strategy it can run."""
    try:
        entry = job.method_entry
    except methods.MethodError as e:
        raise MemoryPlanError(str(e)) from None
    if job.reference is None:
        return
    if not entry.reference:
        raise MemoryPlanError(f"--method {entry.name} trains without a reference model: drop the reference strategy")
    if job.reference not in REFERENCES:
        raise MemoryPlanError(f"reference {job.reference!r} is unknown; use one of {', '.join(REFERENCES)}")
    if job.reference == "adapter" and not job.shape.lora:
        raise MemoryPlanError(
            "the reference as the policy with its adapter disabled needs LoRA: add --use_peft, or use a copy or "
            "--precompute_ref_log_probs"
        )


def estimated_save_s(params: int, trainable: int, zero_stage: int, precision: str) -> float:
    """The planner's write time for this model's checkpoint (llmft.memory.checkpoint_bytes at its default bandwidth)."""

    lora = trainable if trainable < params else 0
    shape = ModelShape("", params, 0, 0, 0, 0, 0, 0, 0, 0, lora_params=lora)
    return checkpoint_bytes(shape, zero_stage, precision) / (WRITE_MB_S[None] * 1e6)
