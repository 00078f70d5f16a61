"""The training methods `llmft train --method` runs, one entry each: everything that differs between SFT, DPO, KTO
and reward modelling lives in METHODS, and every command reads it from here.

`train`, `prepare`, `plan`, the job scripts (METHOD=) and `report` look a method up with `method(name)` and act on the
entry's fields; no code outside this module asks which method it is running (`tests/test_methods.py` holds this:
no `method ==` anywhere else). A fifth method is one new entry.

The table is data, importable without torch or TRL (standard library only): the job launchers check METHOD= and a
SWEEP's flags against it on a batch host's python3, and the planner counts a method's sequences without importing
TRL. Classes are named as "module:attribute" strings and imported by the layer that runs them.

Why these numbers (TRL 1.16, trl/trainer/*_trainer.py):
- DPO and reward models concatenate chosen and rejected into one forward, so a pair is two sequences through the
  policy; DPO's reference sees both again (forward only, no activations kept).
- KTO runs each example and, unless its loss is "apo_zero_unpaired", a mismatched KL completion through the policy
  and the reference: two sequences an example, each direction.
- A reward model ends in a one-output score head (AutoModelForSequenceClassification, num_labels=1), not the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmft.errors import LlmftError


class MethodError(LlmftError):
    """An unknown method, or data or a flag that belongs to another method."""


@dataclass(frozen=True)
class Method:
    """One training method: its TRL classes, its data, what the planner counts, the mixins, the report's plots."""

    name: str
    description: str
    config_class: str  # "trl:SFTConfig": the dataclass llmft's parser reads this method's flags into
    trainer_class: str  # "trl:SFTTrainer"
    # record formats (llmft.data.formats) this method trains on; the first is what --dataset_format auto expects
    formats: tuple[str, ...]
    batch_unit: str  # what --global_batch_size counts: "examples" or "pairs"
    prepared_by: str  # "llmft": the shared cache tokenises with the trainer's own preparation; "trl": the trainer does
    sequences_per_example: int  # sequences one example puts through the policy's forward and backward
    reference: bool  # a frozen reference model scores the same sequences (forward only)
    loss_head: str  # "lm": the LM head over the vocabulary; "score": a one-output classification head
    mixins: tuple[str, ...]  # llmft trainer mixins (llmft.training) that apply to this method's trainer
    report_metrics: tuple[str, ...]  # the logged metrics `llmft report` plots, beside the loss
    packing: str  # "packing": TRL packs rows; "padding_free": rows concatenated without padding; "": neither
    # flags of this method's config that the shared TrainingArguments/llmft policy does not cover:
    # name -> (kind, why), kinds as in llmft.training.flag_policy
    flags: tuple[tuple[str, tuple[str, str]], ...] = ()

    @property
    def flag_policy(self) -> dict[str, tuple[str, str]]:
        return dict(self.flags)


def _passed(rows: dict[str, str], shared: str = "") -> tuple[tuple[str, tuple[str, str]], ...]:
    """A config's own fields (its dataclass's fields less TrainingArguments'), each handed unchanged to TRL's
    trainer (kind "passed", llmft.training.flag_policy.PASSED). `shared`: fields SFTConfig also has, whose
    llmft.training.flag_policy.POLICY row is SFT's; under this method TRL's config of this method reads them."""
    out = {name: ("passed", why) for name, why in rows.items()}
    for name in shared.split():
        out[name] = ("passed", "also SFTConfig's (POLICY's row is SFT's); under this method TRL's {cls} reads it")
    return tuple(sorted(out.items()))


_COMMON_SHARED = (
    "model_init_kwargs trust_remote_code dataset_num_proc max_length pad_to_multiple_of activation_offloading"
)
_REFERENCE_ROWS = {
    "disable_dropout": "TRL disables dropout in the policy (and reference) models",
    "precompute_ref_log_probs": "one reference pass before training; the log-probs join the training data",
    "precompute_ref_batch_size": "the batch size of the precompute pass",
    "beta": "the strength of the pull towards the reference (TRL's beta)",
    "sync_ref_model": "TRL's TR-DPO: the reference is synced to the policy every ref_model_sync_steps",
    "ref_model_mixup_alpha": "TR-DPO's mix of the policy into the reference at each sync",
    "ref_model_sync_steps": "TR-DPO's steps between syncs",
}
_DPO_FLAGS = _passed(
    {
        **_REFERENCE_ROWS,
        "loss_weights": "weights of the losses when several loss_type values are combined (TRL's MPO)",
        "ld_alpha": "LD-DPO's weight on the verbose tail of the longer completion",
        "f_divergence_type": "the f-divergence of the DPO loss (reverse KL by default)",
        "f_alpha_divergence_coef": "the alpha of the alpha-divergence",
        "label_smoothing": "the conservative/robust DPO label smoothing",
        "use_weighting": "WPO's weighting of pairs by their probability",
        "discopop_tau": "DiscoPOP's temperature (loss_type discopop)",
    },
    _COMMON_SHARED + " router_aux_loss_coef truncation_mode padding_free loss_type pad_token",
)
_KTO_FLAGS = _passed(
    {
        **_REFERENCE_ROWS,
        "desirable_weight": "the weight of the desirable (label true) examples' losses",
        "undesirable_weight": "the weight of the undesirable (label false) examples' losses",
    },
    _COMMON_SHARED + " router_aux_loss_coef loss_type",
)
_REWARD_FLAGS = _passed(
    {
        "disable_dropout": "TRL disables dropout in the reward model",
        "center_rewards_coefficient": "the auxiliary loss that centres the rewards on zero",
    },
    _COMMON_SHARED + " chat_template_path eos_token pad_token",
)


def _named(flags, cls: str):
    return tuple((name, (kind, why.replace("{cls}", cls))) for name, (kind, why) in flags)


_PREFERENCE_PLOTS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")

METHODS: dict[str, Method] = {
    "sft": Method(
        name="sft",
        description="supervised fine-tuning on text, prompt/completion or conversations",
        config_class="trl:SFTConfig",
        trainer_class="trl:SFTTrainer",
        formats=("text", "prompt_completion", "messages", "alpaca", "sharegpt"),
        batch_unit="examples",
        prepared_by="llmft",
        sequences_per_example=1,
        reference=False,
        loss_head="lm",
        mixins=("sync_free", "checkpoint_save", "ulysses"),
        report_metrics=("mean_token_accuracy",),
        packing="packing",
    ),
    "dpo": Method(
        name="dpo",
        description="direct preference optimisation on chosen/rejected pairs against a frozen reference",
        config_class="trl:DPOConfig",
        trainer_class="trl:DPOTrainer",
        formats=("preference",),
        batch_unit="pairs",
        prepared_by="trl",
        sequences_per_example=2,
        reference=True,
        loss_head="lm",
        mixins=("checkpoint_save",),
        report_metrics=_PREFERENCE_PLOTS,
        packing="padding_free",
        flags=_named(_DPO_FLAGS, "DPOConfig"),
    ),
    "kto": Method(
        name="kto",
        description="Kahneman-Tversky optimisation on unpaired completions labelled desirable or not",
        config_class="trl:KTOConfig",
        trainer_class="trl:KTOTrainer",
        formats=("unpaired_preference",),
        batch_unit="examples",
        prepared_by="trl",
        sequences_per_example=2,
        reference=True,
        loss_head="lm",
        mixins=("checkpoint_save",),
        report_metrics=("rewards/chosen", "rewards/rejected", "rewards/margins", "kl"),
        packing="",
        flags=_named(_KTO_FLAGS, "KTOConfig"),
    ),
    "reward": Method(
        name="reward",
        description="a reward model: a one-output score head trained to rank chosen above rejected",
        config_class="trl:RewardConfig",
        trainer_class="trl:RewardTrainer",
        formats=("preference",),
        batch_unit="pairs",
        prepared_by="trl",
        sequences_per_example=2,
        reference=False,
        loss_head="score",
        mixins=("checkpoint_save",),
        report_metrics=("accuracy", "margin"),
        packing="",
        flags=_named(_REWARD_FLAGS, "RewardConfig"),
    ),
}

DEFAULT = "sft"


def method(name: str | None) -> Method:
    """The entry for --method / METHOD=; None means the default (sft). An unknown name is one line naming the choices."""
    key = DEFAULT if name in (None, "") else name
    if key not in METHODS:
        raise MethodError(f"--method {name!r} is not a training method; choose one of {', '.join(METHODS)}")
    return METHODS[key]


def is_default(name: str | None) -> bool:
    """The default method (sft), which every command runs as it did before --method: its run directories, arguments
    and reports keep their names, so callers ask here rather than compare names themselves."""
    return name in (None, "", DEFAULT)
