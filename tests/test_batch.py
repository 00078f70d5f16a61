"""Batch math: the global batch a user asks for is what DeepSpeed runs, on any world size."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmft.planning.batch import BatchError, nearest_global_batches, plan_batch, valid_micro_batches


def test_accumulation_adapts_to_gpu_count_keeping_global_batch():
    one_gpu = plan_batch(world_size=1, micro_batch=2, global_batch=32)
    four_gpus = plan_batch(world_size=4, micro_batch=2, global_batch=32)
    assert (one_gpu.grad_accum, one_gpu.global_batch) == (16, 32)
    assert (four_gpus.grad_accum, four_gpus.global_batch) == (4, 32)


def test_without_global_batch_it_follows_from_micro_and_accumulation():
    assert plan_batch(world_size=8, micro_batch=2, grad_accum=3).global_batch == 48


def test_indivisible_global_batch_names_nearest_valid_values():
    with pytest.raises(BatchError) as e:
        plan_batch(world_size=4, micro_batch=2, global_batch=30)
    msg = str(e.value)
    assert "30" in msg and "8" in msg  # the problem: 30 over 2 x 4
    assert "use global batch 24 or 32" in msg
    assert "or micro-batch" not in msg  # 30 samples cannot be split evenly over 4 GPUs at any micro-batch


def test_indivisible_global_batch_suggests_micro_batches_when_some_fit():
    with pytest.raises(BatchError) as e:
        plan_batch(world_size=2, micro_batch=3, global_batch=16)
    assert "use global batch 12 or 18, or micro-batch 2 or 4" in str(e.value)


def test_global_smaller_than_one_step_suggests_smaller_micro_batch():
    with pytest.raises(
        BatchError, match=r"smaller than micro-batch 4 x world size 4 = 16; use global batch 16, or micro-batch 1 or 2"
    ):
        plan_batch(world_size=4, micro_batch=4, global_batch=8)


def test_contradicting_accumulation_is_refused():
    with pytest.raises(BatchError, match="contradicts"):
        plan_batch(world_size=2, micro_batch=2, global_batch=16, grad_accum=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world_size=0, micro_batch=1),
        dict(world_size=1, micro_batch=0),
        dict(world_size=1, micro_batch=1, global_batch=-8),
    ],
)
def test_non_positive_numbers_are_refused(kwargs):
    with pytest.raises(BatchError, match="positive integer"):
        plan_batch(**kwargs)


sizes = st.integers(min_value=1, max_value=64)


@settings(max_examples=300, deadline=None)
@given(world=sizes, micro=sizes, global_batch=st.integers(min_value=1, max_value=4096))
def test_plan_is_exact_or_the_error_offers_only_valid_alternatives(world, micro, global_batch):
    try:
        plan = plan_batch(world_size=world, micro_batch=micro, global_batch=global_batch)
    except BatchError as e:
        assert global_batch % (micro * world) != 0
        for g in nearest_global_batches(global_batch, micro, world):
            assert plan_batch(world_size=world, micro_batch=micro, global_batch=g).global_batch == g
            assert str(g) in str(e)
        for m in valid_micro_batches(global_batch, world):
            assert plan_batch(world_size=world, micro_batch=m, global_batch=global_batch).global_batch == global_batch
    else:
        assert plan.global_batch == global_batch
        assert plan.micro_batch * plan.grad_accum * plan.world_size == global_batch
        assert plan.grad_accum >= 1


@settings(max_examples=200, deadline=None)
@given(micro=sizes, accum=sizes, gpus=st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
def test_global_batch_survives_any_power_of_two_rescale(micro, accum, gpus):
    """A config sized for 64 GPUs keeps its global batch on fewer GPUs with more accumulation."""
    global_batch = micro * accum * 64
    plan = plan_batch(world_size=gpus, micro_batch=micro, global_batch=global_batch)
    assert plan.global_batch == global_batch
    assert plan.grad_accum == accum * 64 // gpus
