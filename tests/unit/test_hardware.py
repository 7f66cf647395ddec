"""Hardware model: ordering, scaling laws and magnitudes."""

import pytest

from app.hardware.specs import BatchShape, PrefillChunk, get_gpu, make_instance

pytestmark = pytest.mark.unit


def decode_batch(batch_size: int, context: int) -> BatchShape:
    return BatchShape(num_decode_seqs=batch_size, decode_context_tokens=batch_size * context)


def test_decode_ordering_follows_memory_bandwidth():
    times = {
        g: make_instance(g, "llama-3.1-8b").iteration_time_s(decode_batch(8, 1024))
        for g in ("H200", "H800", "A800", "A40")
    }
    assert times["H200"] < times["H800"] < times["A800"] < times["A40"]


def test_decode_is_weights_plus_kv_over_bandwidth():
    inst = make_instance("A800", "llama-3.1-8b")
    gpu, model = inst.gpu, inst.model
    batch = decode_batch(16, 2048)
    bytes_read = model.num_params * model.bytes_per_param + 16 * 2048 * model.kv_bytes_per_token
    memory_bound_s = bytes_read / gpu.effective_bandwidth
    t = inst.iteration_time_s(batch)
    assert memory_bound_s < t < memory_bound_s * 1.4
    # Llama-3.1-8B decodes at roughly 10-20 ms per step on an A100-class GPU
    assert 0.008 < inst.decode_time_per_token_s() < 0.025


def test_prefill_is_about_linear_in_tokens():
    inst = make_instance("H800", "llama-3.1-8b")
    t1 = inst.iteration_time_s(BatchShape.build([PrefillChunk(2048)]))
    t2 = inst.iteration_time_s(BatchShape.build([PrefillChunk(4096)]))
    assert 1.8 < t2 / t1 < 2.3
    flops = 2 * 4096 * inst.model.num_params
    assert t2 > flops / inst.gpu.effective_flops  # never faster than the compute roofline


def test_long_context_attention_is_superlinear():
    inst = make_instance("A800", "llama-3.1-8b")
    short = inst.iteration_time_s(BatchShape.build([PrefillChunk(1024, 0)]))
    late = inst.iteration_time_s(BatchShape.build([PrefillChunk(1024, 60000)]))
    assert late > 1.5 * short


def test_tensor_parallel_speeds_up_but_sublinearly():
    one = make_instance("A100", "llama-3.1-8b", 1).decode_time_per_token_s()
    two = make_instance("A100", "llama-3.1-8b", 2).decode_time_per_token_s()
    assert one / 2 < two < one


def test_solo_latency_matches_stepwise_sum():
    inst = make_instance("A40", "llama-3.1-8b")
    stepwise = inst.iteration_time_s(BatchShape.build([PrefillChunk(700)]))
    stepwise += sum(
        inst.iteration_time_s(decode_batch(1, 700 + i)) for i in range(1, 120)
    )
    assert inst.solo_latency_s(700, 120) == pytest.approx(stepwise, rel=1e-3)


def test_model_that_does_not_fit_is_rejected():
    with pytest.raises(ValueError, match="does not fit"):
        make_instance("L4", "llama-2-70b")


def test_unknown_names_give_clear_errors():
    with pytest.raises(ValueError, match="unknown GPU type"):
        get_gpu("TPUv9")
    with pytest.raises(ValueError, match="unknown model"):
        make_instance("A800", "gpt-9")


def test_empty_batch_costs_nothing():
    assert make_instance("A800", "llama-3.1-8b").iteration_time_s(BatchShape()) == 0.0


def test_cpu_profile_is_registered():
    cpu = get_gpu("cpu")
    tiny = make_instance("cpu", "tiny-llama")
    assert cpu.peak_tflops > 0 and tiny.kv_capacity_tokens > 10_000
