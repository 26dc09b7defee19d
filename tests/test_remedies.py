"""Remedies by framework and compute capability."""

from __future__ import annotations

import pytest

from gpuscope.analysis.findings import FINDING_KINDS
from gpuscope.analysis.patterns import REMEDIES
from gpuscope.analysis.remedies import remedy_for


@pytest.mark.parametrize("framework", ["", "pytorch", "tensorflow", "jax", "other"])
@pytest.mark.parametrize("capability", [None, (7, 0), (8, 0), (9, 0)])
def test_every_finding_has_a_remedy(framework: str, capability: tuple[int, int] | None) -> None:
    for kind in FINDING_KINDS:
        assert remedy_for(kind, framework=framework, capability=capability), kind


@pytest.mark.parametrize(("framework", "expected"), [
    ("pytorch", "torch.amp.GradScaler"), ("tensorflow", "mixed_float16"), ("jax", "float16")])
@pytest.mark.parametrize("capability", [(7, 0), (7, 5)])
def test_volta_and_turing_are_told_fp16_never_bf16_or_tf32(framework: str, expected: str,
                                                           capability: tuple[int, int]) -> None:
    text = remedy_for("tensor_cores_idle", framework=framework, capability=capability)
    assert expected in text
    assert not any(word in text.lower() for word in ("bf16", "bfloat16", "tf32", "tensorfloat"))


def test_ampere_gets_bf16_and_tf32_and_hopper_also_fp8() -> None:
    ampere = remedy_for("tensor_cores_idle", framework="pytorch", capability=(8, 0))
    hopper = remedy_for("tensor_cores_idle", framework="pytorch", capability=(9, 0))
    assert "torch.bfloat16" in ampere and "allow_tf32" in ampere and "FP8" not in ampere
    assert "FP8" in hopper and "Transformer Engine" in hopper
    assert "FP8" in remedy_for("tensor_cores_idle", framework="jax", capability=(8, 9))


def test_an_unknown_gpu_is_given_both_with_the_condition() -> None:
    text = remedy_for("tensor_cores_idle", framework="pytorch", capability=None)
    assert "8.0 or newer" in text and "torch.bfloat16" in text and "GradScaler" in text


def test_each_framework_gets_its_own_words() -> None:
    assert "tf.data" in remedy_for("input_bound", framework="tensorflow", capability=None)
    tensorflow = remedy_for("launch_bound", framework="tensorflow", capability=None)
    assert "TF_GPU_THREAD_MODE=gpu_private" in tensorflow
    assert "jax.jit" in remedy_for("launch_bound", framework="jax", capability=None)
    assert "scaled_dot_product_attention" in remedy_for("dominant_op", framework="pytorch", capability=None)
    assert remedy_for("costly_op", framework="", capability=None) == REMEDIES["costly_op"]
