"""benchmarks/gpu/perf.sh (GPT-2 large ours vs transformers, with the kernel-time breakdown): the
kernel-family classifier on real CUDA kernel names, the switch lists through the real parser, and
the whole script in its CPU smoke mode (every step must pass and the tables come last)."""

import json
import subprocess

import pytest

from tests.functional_tests.runner import REPO, env_for_tests


@pytest.fixture
def perf(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import perf

    return perf


# Names as torch.profiler (CUPTI) reports them on A100/H100/H200 runs, and ATen operators (the
# CPU smoke mode classifies those).
KERNELS = {
    "matrix products": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute"
        "_segment_k_off_kernel__5x_cublas",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_"
        "align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)",
        "triton_tem_fused_mm_0",
        "aten::addmm",
        "aten::mm",
        "aten::bmm",
    ],
    "attention": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
        "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >"
        ", false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits"
        "<64, 128, 128, 8, 4, 2, 2, false, false, cutlass::bfloat16_t>, true, false, false, "
        "false, false, false>(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
        "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_128x64_k128_sm80(PyTorchMemEffAttention::AttentionBackward"
        "Kernel<cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 128, 64, 128>"
        "::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ],
    "elementwise": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::"
        "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()"
        "#4}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, "
        "at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()"
        "#2}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "at::detail::Array<char*, 2>)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
        "float>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, "
        "float*, float*, c10::BFloat16*)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<"
        "float>, unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::MaxOps<float>"
        ", unsigned int, float, 4>)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, "
        "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16,"
        " float, long>(long const*, c10::BFloat16 const*, c10::BFloat16*, int, long, int)",
        "triton_poi_fused_add_native_dropout_0",
        "triton_red_fused_native_layer_norm_1",
        "aten::gelu",
        "aten::add_",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous"
        " namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMath"
        "Functor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, "
        "double, double, bool, float*, float*>(at::native::(anonymous namespace)::TensorList"
        "Metadata<4>, ...)",
        "void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, double>(float "
        "const*, at::native::TensorListAddresses, int)",
        "aten::_foreach_add_",
        "aten::_fused_adamw_",
    ],
    "communication": [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWork*)",
        "gloo:all_reduce",
        "c10d::allreduce_",
    ],
    "copies": [
        "Memcpy HtoD (Pageable -> Device)",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() "
        "const::{lambda(float)#1}, at::detail::Array<char*, 2> >(int, ...)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
        "namespace)::OpaqueType<2u>, unsigned int, 3, 64, 64>(...)",
        "aten::copy_",
        "aten::_to_copy",
    ],
    "other": ["ProfilerStep#11", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"],
}


def test_kernel_families_of_real_kernel_names(perf):
    import kernels

    wrong = {
        name: (kernels.family(name), expected)
        for expected, names in KERNELS.items()
        for name in names
        if kernels.family(name) != expected
    }
    assert not wrong, wrong
    assert set(KERNELS) == set(kernels.FAMILIES)
    rows = [(name, 1.0) for names in KERNELS.values() for name in names]
    totals = kernels.summarize(rows + [("nvjet_tst_64x8_64x16", 2.5)])
    assert totals["matrix products"] == len(KERNELS["matrix products"]) + 2.5
    assert sum(totals.values()) == len(rows) + 2.5  # nothing dropped
    assert [name for name, _ in kernels.top_unclassified(rows, 1)] == [KERNELS["other"][0]]


def test_cuda_rows_are_the_kernels_only(perf):
    """On CUDA an operator's row carries its kernels' time as well: only the device's own rows
    count (else every kernel counts twice)."""
    import kernels
    from torch.autograd import DeviceType

    class Row:
        def __init__(self, key, device_type, device_us, cpu_us):
            self.key, self.device_type = key, device_type
            self.self_device_time_total, self.self_cpu_time_total = device_us, cpu_us

    class Profiler:
        def key_averages(self):
            return [
                Row("aten::mm", DeviceType.CPU, 40.0, 9.0),
                Row("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", DeviceType.CUDA, 40.0, 0.0),
                Row("Memcpy HtoD (Pageable -> Device)", DeviceType.CUDA, 2.0, 0.0),
                Row("cudaLaunchKernel", DeviceType.CPU, 0.0, 3.0),
            ]

    assert kernels.profiler_rows(Profiler(), "cuda") == [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", 40.0),
        ("Memcpy HtoD (Pageable -> Device)", 2.0),
    ]
    assert kernels.profiler_rows(Profiler(), "cpu") == [
        ("aten::mm", 9.0),
        ("cudaLaunchKernel", 3.0),
    ]


def test_switch_lists_pass_the_parser_and_cuda_only_flags_stay_off_cpu(
    perf, tmp_path, capsys, monkeypatch
):
    import steps

    from megatron.training import dry_run

    monkeypatch.delenv("GPU_PERF_OURS_FLAGS", raising=False)
    step = steps.Step("o", "gpu", tmp_path, 90)
    base = steps.gpt2_flags(step, 32, tmp_path / "tb")
    for choice in ("optimised", "plain"):
        flags = perf.ours_flags(choice, gpu=True)
        code = dry_run.main(["--dry-run-world-size", "1", "--dry-run-model", "gpt"] + base + flags)
        assert code == 0, f"{choice}: {capsys.readouterr().err[-2000:]}"
    assert perf.ours_flags("optimised", gpu=True) == perf.OPTIMISED_FLAGS
    assert "--cuda-graph-impl" not in perf.ours_flags("optimised", gpu=False)
    assert "--cross-entropy-loss-fusion" in perf.ours_flags("optimised", gpu=False)
    assert perf.ours_flags("plain", gpu=True) == perf.PLAIN_FLAGS
    monkeypatch.setenv("GPU_PERF_OURS_FLAGS", "--cuda-graph-impl local --no-rope-fusion")
    assert perf.ours_flags("plain", gpu=False) == ["--no-rope-fusion"]


@pytest.mark.timeout(600)
def test_perf_passes_every_step_in_cpu_mode(tmp_path):
    env = env_for_tests()
    env["OUT"] = str(tmp_path)
    env.pop("PERF_MODE", None)
    env.pop("GPU_PERF_OURS_FLAGS", None)
    result = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu" / "perf.sh"), "--cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        # The CPU steps' limits add up to 500 s; about 60 s on a quiet 2-core machine, 2-3
        # minutes on a busy one.
        timeout=560,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert result.stdout.rstrip().endswith(summary.rstrip()), result.stdout[-3000:]
    rows = {
        line[:4].strip(): line
        for line in summary.splitlines()
        if line[:4].strip() in ("a", "o", "h", "c")
    }
    failed = {step: row for step, row in rows.items() if row[42:50].strip() != "PASS"}
    assert sorted(rows) == sorted("aohc") and not failed, summary + result.stderr[-2000:]
    assert result.returncode == 0, summary
    # The comparison table is last, with the three runs and the kernel families.
    assert summary.rstrip().endswith((tmp_path / "perf.txt").read_text().rstrip())
    for run in ("ours (optimised)", "transformers eager", "transformers torch.compile"):
        assert run in summary
    results = json.loads((tmp_path / "results.json").read_text())
    ours = results["o"]
    assert ours["switches"] == [
        "--cross-entropy-loss-fusion",
        "--cross-entropy-fusion-impl",
        "native",
    ]
    assert ours["tflops"] > 0 and ours["peak_allocated_mb"] > 0
    assert ours["kernel_ms_per_iteration"]["matrix products"] > 0
    assert results["c"]["compile_backend"] == "eager" and results["h"]["compile_backend"] is None
    assert results["h"]["micro_batch"] == ours["micro_batch"]
