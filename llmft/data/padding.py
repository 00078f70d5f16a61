"""What padding costs a run and what padding-free batches and --packing would change, from the prepared data's lengths.

A padded micro-batch of m samples is m x (its longest sample) tokens; the rest of each row is padding, computed
and thrown away. With lengths drawn at random (the sampler shuffles), the expected longest of m samples follows
from the length distribution alone: P(max <= x) = F(x)^m (drawing with replacement, which a shuffled epoch
approaches when the data is much larger than a micro-batch). So, before training:

- padding share: 1 - mean / E[max of m], the share of the tokens fed that are padding;
- padding-free (same samples per micro-batch, no pad tokens): at most 1 / (1 - share) the real tokens per second,
  the tokens it stops computing (attention, quadratic in length, gains less; small micro-batches may gain less
  where the GPU was not busy);
- --packing (TRL's bfd): rows of up to --max_length hold whole samples, about max_length / mean of them, and
  `--per_device_train_batch_size` counts rows: each optimizer step trains that many times more samples (fewer
  steps per epoch); no padding at all.

`llmft train` logs this after preparing the data; `llmft plan --prepared DIR` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaddingReport:
    samples: int
    mean_length: float
    longest: int
    micro_batch: int
    expected_padded_length: float  # E[longest of a micro-batch]: what each padded row is long
    padding_share: float  # of the tokens a padded batch feeds
    padding_free_gain: float  # upper bound on real tokens/s, padding-free over padded
    samples_per_packed_row: float  # --packing: samples in a row of max_length (bfd fills rows nearly full)
    max_length: int | None

    def lines(self, *, packing: bool, padding_free: bool) -> list[str]:
        """What the start lines say about this data with this run's settings."""
        head = (
            f"data: {self.samples} sequences, mean {self.mean_length:.0f} tokens, longest {self.longest}; padded to the "
            f"longest of a micro-batch of {self.micro_batch}, {self.padding_share:.0%} of the tokens fed are padding"
        )
        if packing:
            return [
                head.replace("are padding", "would be padding") + f"; --packing: no padding, about "
                f"{self.samples_per_packed_row:.0f} samples per row of {self.max_length} tokens, so each micro-batch "
                f"(and optimizer step) holds about {self.samples_per_packed_row:.0f}x the samples it would unpacked"
            ]
        if padding_free:
            return [
                head.replace("are padding", "would be padding") + " (padding-free: none is fed, up to "
                f"{self.padding_free_gain:.2f}x the real tokens/s of padded batches)"
            ]
        advice = []
        if self.padding_share >= 0.05:
            advice.append(
                f"padding-free batches would feed none (up to {self.padding_free_gain:.2f}x the real tokens/s; "
                "the default on GPUs with a varlen attention kernel, --padding_free true)"
            )
            if self.max_length and self.samples_per_packed_row >= 2:
                advice.append(
                    f"--packing also fills rows of {self.max_length} with about {self.samples_per_packed_row:.0f} "
                    f"samples each (about {self.samples_per_packed_row:.0f}x the samples per step: lower "
                    "--global_batch_size to keep them)"
                )
        return [head + (": " + "; ".join(advice) if advice else " (padding-free would gain little)")]

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def expected_longest(lengths: list[int], m: int) -> float:
    """E[max of m lengths drawn at random from `lengths`] (with replacement): sum over distinct lengths x of
    x * (F(x)^m - F(x-)^m)."""
    if not lengths:
        return 0.0
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    total, below, expected = len(lengths), 0, 0.0
    for x in sorted(counts):
        at_most = below + counts[x]
        expected += x * ((at_most / total) ** m - (below / total) ** m)
        below = at_most
    return expected


def padding_report(lengths: list[int], micro_batch: int, max_length: int | None) -> PaddingReport:
    """PaddingReport for samples of these lengths (tokens, as prepared: truncated, unpacked) in micro-batches of
    `micro_batch`, packed rows of `max_length`."""
    if not lengths or micro_batch < 1:
        raise ValueError("padding_report needs at least one length and a micro-batch of 1 or more")
    mean = sum(lengths) / len(lengths)
    padded = expected_longest(lengths, micro_batch)
    share = max(0.0, 1.0 - mean / padded) if padded else 0.0
    per_row = (max_length / mean) if max_length and mean else 1.0
    return PaddingReport(
        samples=len(lengths),
        mean_length=mean,
        longest=max(lengths),
        micro_batch=micro_batch,
        expected_padded_length=padded,
        padding_share=share,
        padding_free_gain=padded / mean if mean else 1.0,
        samples_per_packed_row=max(1.0, per_row),
        max_length=max_length,
    )


def prepared_lengths(dataset) -> list[int]:
    """Token counts of a prepared (tokenised, unpacked) datasets.Dataset, read from its Arrow column (no decoding);
    packed rows carry the samples' own lengths in `seq_lengths`."""
    import pyarrow.compute as pc

    table = dataset.data
    if "seq_lengths" in table.column_names:
        return [int(n) for n in pc.list_flatten(table.column("seq_lengths")).to_pylist()]
    return pc.list_value_length(table.column("input_ids")).to_pylist()
