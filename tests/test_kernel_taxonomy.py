"""The kernel taxonomy on real kernel names: names that profilers (Kineto, Nsight Systems, TensorFlow's
and XLA's profilers) recorded for cuBLAS, cuDNN, CUTLASS, NCCL, ATen, Eigen, XLA and the inference
engines' kernels. Every row of the table is exercised by at least one of them."""

from __future__ import annotations

import re

import pytest

from gpuscope.analysis.kernel_taxonomy import (
    LOG_SOFTMAX,
    TAXONOMY,
    classify,
    classify_name,
    short_name,
    without_parameters,
)
from gpuscope.analysis.model import Kind

NAMES: list[tuple[str, str]] = [
    # Collectives: NCCL, symmetric memory, custom all-reduce, Lamport all-reduce.
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)", "collective"),
    ("ncclKernel_AllReduce_RING_LL_Sum_half(ncclDevComm*, unsigned long, ncclWork*)", "collective"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", "collective"),
    ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsi"
     "gned long, "
     "unsigned int**, unsigned long, unsigned long)", "collective"),
    ("two_shot_all_reduce_kernel_inplace", "collective"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, "
     "vllm::Signal*, __nv_bfloat16*, int, int)", "collective"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<(flashinfer::"
     "trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, false, false>", "collective"),
    # Foreach kernels (the optimizer's): elementwise.
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, "
     "std::plus<float>, float>", "elementwise"),
    # cuDNN's layout conversions.
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true, "
     "(cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nchw2nhwc_params_t<float>, float const*, float*)",
     "layout"),
    ("void cudnn::engines_precompiled::nhwcToNchwKernel<float, float, float, true, false, "
     "(cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nhwc2nchw_params_t<float>, float const*, float*)",
     "layout"),
    ("void tensorTransformGeneric<float, float, float, true, false, false, (cudnnKernelDataType_t)2>"
     "(cudnnTensorTransformStruct, tensorTransformParams, int, unsigned long, float const*, float*, float)",
     "layout"),
    # fp32 memory-efficient attention, then fused attention on the tensor cores.
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "fp32_matmul"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "tensor_core"),
    ("pytorch_flash::flash_fwd_kernel", "tensor_core"),
    ("flash_fwd_splitkv_kernel", "tensor_core"),
    # fp32 on the SIMT cores.
    ("volta_sgemm_128x64_nn", "fp32_matmul"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>(cutlass_80_simt_sgemm_256x1"
     "28_8x4_nt_"
     "align1::Params)", "fp32_matmul"),
    ("cutlass3x_sm100_simt_sgemm_f32_f32_f32_f32_f32_64x128x16_1x1x1_3_tnn_align1_bias_f32_relu", "f"
     "p32_matmul"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x128x8_stage3_warpsize1x2x1_ffma_aligna4_align"
     "c4_execute_"
     "kernel__5x_cublas", "fp32_matmul"),
    ("sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize128x32x8_stage3_warpsize2x2x1_g1_"
     "ffma_aligna4_alignc4_execute_kernel__5x_cudnn", "fp32_matmul"),
    ("volta_scudnn_128x64_relu_interior_nn_v1", "fp32_matmul"),
    ("turing_scudnn_128x64_stridedB_splitK_xregs_large_nn_v1", "fp32_matmul"),
    ("void implicit_convolve_sgemm<float, float, 1024, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int, "
     "float const*, int, float*, float const*, kernel_conv_params, unsigned long long, int)", "fp32_matmul"),
    ("sgemm_largek_lds64<true, false, 5, 5, 4, 4, 4, 34>(float*, float const*, float const*, int, int, int)",
     "fp32_matmul"),
    # A depthwise convolution: no tensor cores to use.
    ("void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel<3, float, float, int>",
     "convolution"),
    ("void cudnn::cnn::conv2d_grouped_direct_kernel<float, float, float, float, float, float, true, "
     "false, 0, 0, "
     "0>(cudnnTensorStruct, float const*, cudnnFilterStruct, float const*)", "convolution"),
    # cuDNN's fp32 engines, cuBLAS's fp32 GEMV and small GEMMs, Eigen's fp32 contraction.
    ("void wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>(int, int, int, float const*, int"
     ", float*, "
     "float const*, kernel_grad_params, unsigned long long, int, float, int, int, int, int)", "fp32_matmul"),
    ("void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>", "fp32_matmul"),
    ("void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(cudnn::winograd_nonfused::"
     "WinogradDataParams<float, float>)", "fp32_matmul"),
    ("void cudnn::cnn::reduce_wgrad_nchw_helper<float, float>(void*, void const*, float, int, int)",
     "fp32_matmul"),
    ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 8, 9, false, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float> >", "fp32_matmul"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 2, 2, false, false, "
     "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >",
     "fp32_matmul"),
    ("_ZN5Eigen32EigenFloatContractionKernel", "fp32_matmul"),
    # Tensor cores by generation.
    ("volta_h884gemm_64x64_nt", "tensor_core"),
    ("volta_s884gemm_fp16_128x64_ldg8_tn", "tensor_core"),
    ("volta_fp16_s884gemm_fp16_128x64_ldg8_f2f_nn", "tensor_core"),
    ("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_tn", "tensor_core"),
    ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_nn", "tensor_core"),
    ("ampere_fp16_s16816gemm_fp16_64x64_ldg8_f2f_stages_64x6_tn", "tensor_core"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_tn_align4>(cutlass_80_tensoro"
     "p_s1688gemm_"
     "128x128_32x3_tn_align4::Params)", "tensor_core"),
    ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_s1688dgrad_optimized_tf32_256x64_16x4_nhwc_uni"
     "ty_stride_"
     "align4>(cutlass_tensorop_s1688dgrad_optimized_tf32_256x64_16x4_nhwc_unity_stride_align4::Params)",
     "tensor_core"),
    ("cutlass3x_sm100_tensorop_gemm_64x128f32xe4m3_1x128f32xe4m3_f32_f16_f16_64x128x128_1x1x1_0_nnn_"
     "align16_1sm",
     "tensor_core"),
    ("cutlass3x_sm100_bstensorop_s256x128x64gemm_block_scaled_ue4m3xf4_ue4m3", "tensor_core"),
    # cuBLASLt's nvjet kernels, TensorRT-LLM's block-scaled batched GEMMs (MXFP4, FP8).
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "tensor_core"),
    ("nvjet_tst_64x8_64x16_1x1_h_bz_TNT", "tensor_core"),
    ("bmm_E4m3_E4m3E4m3_Fp32_t128x8x128u2_s8_et64x8_m64x8x32_cga1x1x1_16dp256b_rM_TN_transOut_noShflA_dsFp8_"
     "schedP4x2x2x3_bN_ldgsts_tmaOpt_clmp_dynBatch_sm100f", "tensor_core"),
    ("bmm_Bfloat16_MxE2m1MxE4m3_Fp32_Ab32_Bb32_t128x128x256u2_s4_et128x64_m256x128x32_c2x1x1_rM_TN_transOut_"
     "schPd2x1x2x3_biasFp32M_bN_rgTma_c", "tensor_core"),
    ("bmm_MxE4m3_MxE2m1MxE4m3_Fp32_t128x64x256_s3_et128x64_m128x64x32_cga1x1x1_16dp256b_TN_transOut_"
     "schedS_biasM"
     "_bN_ldgsts_tmaOpt_clmp_swiGlu_d", "tensor_core"),
    ("bmm_Bfloat16_MxInt4Bfloat16_castBfloat16_Fp32_Ab32_t128x32x256u2_s3_et128x32_m256x32x16_c2x1x1_rM_BN_"
     "transOut_schPd2x1x2x3_bN_tma_tmaSf", "tensor_core"),
    # Matrix kernels with a tensor-core operand type; Hopper's xmma.
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
     "kernel__5x_cublas", "tensor_core"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x256x32_warpgroupsize2x1x1_execute_segment_k"
     "_off_kernel"
     "__5x_cublas", "tensor_core"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x32"
     "x16_stage1_"
     "warpsize4x1x1_g1_tensor16x8x8_aligna4_alignc8_execute_kernel__5x_cudnn", "tensor_core"),
    # A convolution engine of no stated precision.
    ("void convolve_common_engine_float_NHWC<__half, __half, 128, 5, 5, 3, 3, 3, true, false, false, false, "
     "false>(int, int, int, __half const*, __half const*, int, __half*)", "convolution"),
    # Matrix kernels of unknown kind: FP64, Triton's, GEMM helpers.
    ("ampere_dgemm_64x64_nn", "other_matmul"),
    ("triton_mm_18", "other_matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, true, true, false>"
     "(cublasLt::cublasSplitKParams<float>, float const*, float const*, float*, float const*)", "oth"
     "er_matmul"),
    ("void cask_plugin__5x_cudnn::xmma__5x_cudnn::init_device_workspace_kernel<xmma__5x_cudnn::impli"
     "cit_gemm::"
     "fprop::Warp_specialized_params_non_template<xmma__5x_cudnn::Grid_constant_params> >(bool)", "o"
     "ther_matmul"),
    # Casts, though "conv" is in their names.
    ("void Eigen::internal::EigenMetaKernel<Eigen::TensorEvaluator<Eigen::TensorAssignOp<Eigen::TensorMap<"
     "Eigen::Tensor<Eigen::half, 1, 1, long>, 16, Eigen::MakePointer>, Eigen::TensorConversionOp<Eig"
     "en::half, "
     "Eigen::TensorMap<Eigen::Tensor<float const, 1, 1, long>, 16, Eigen::MakePointer> const> const> const, "
     "Eigen::GpuDevice>, long>(Eigen::TensorEvaluator<Eigen::TensorAssignOp<Eigen::TensorMap<Eigen::Tensor<"
     "Eigen::half, 1, 1, long>, 16, Eigen::MakePointer>, Eigen::TensorConversionOp<Eigen::half>>>)",
     "elementwise"),
    ("loop_convert_fusion", "elementwise"),
    ("input_convert_f16_fusion", "elementwise"),
    # Softmax: unfused attention's and the loss's.
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
     "(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", "softmax"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 4, true, false>(float*, "
     "float const*, "
     "int, int, int, bool const*, int, bool)", "softmax"),
    ("void at::native::(anonymous namespace)::cunn_SpatialSoftMaxForward<float, float, float, int, a"
     "t::native::"
     "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int, int, int)", "softmax"),
    ("scaled_masked_softmax_warp_forward", "softmax"),
    ("softmax_fw_kernel_resident", "softmax"),
    ("triton_per_fused__softmax_3", "softmax"),
    # Transposes.
    ("void tensorflow::functor::SwapDimension1And2InTensor3UsingTiles<unsigned int, 1024, 1024, 2, false>"
     "(unsigned int const*, tensorflow::functor::Dimension<3>, unsigned int*)", "layout"),
    # Normalisation and reductions.
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, "
     "float const*, float const*, float const*, float*, float*, float*)", "reduction"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>(long, float*)",
     "reduction"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 128, true, 1, true>(cudnnTensorStruct, float "
     "const*, cudnnTensorStruct, float*, float const*, float const*, float, float, float*, float*)",
     "reduction"),
    ("cudnn::bn_fw_inf_1C11_kernel_NCHW", "reduction"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, "
     "float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, fl"
     "oat, float, "
     "float>, unsigned int, float, 4, 4>)", "reduction"),
    ("void tensorflow::functor::RowReduceKernel<float const*, float*, cub::Sum>(float const*, float*"
     ", int, int, "
     "cub::Sum, std::iterator_traits<float const*>::value_type)", "reduction"),
    ("input_reduce_fusion", "reduction"),
    ("void at::native::(anonymous namespace)::max_pool_forward_nchw<float, int>(int, float const*, l"
     "ong, long)",
     "reduction"),
    ("void at::native::(anonymous namespace)::nll_loss2d_forward_kernel<float, float, int>(float*, float*, "
     "float const*, long const*, float const*, int, int, int, long)", "reduction"),
    # Elementwise.
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::arr"
     "ay<char*, "
     "3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIte"
     "ratorBase&)"
     "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::"
     "array<char*, "
     "2ul>, 4, TrivialOffsetCalculator<1, unsigned int>>", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>(int)",
     "elementwise"),
    ("void Eigen::internal::EigenMetaKernel<Eigen::TensorEvaluator<Eigen::TensorAssignOp<Eigen::TensorMap<"
     "Eigen::Tensor<float, 1, 1, long>, 16, Eigen::MakePointer>, Eigen::TensorCwiseBinaryOp<Eigen::internal::"
     "scalar_sum_op<float const, float const>, Eigen::TensorMap<Eigen::Tensor<float, 1, 1, long>, 16, "
     "Eigen::MakePointer> const, Eigen::TensorMap<Eigen::Tensor<float const, 1, 1, long>, 16, "
     "Eigen::MakePointer> const> const> const, Eigen::GpuDevice>, long>", "elementwise"),
    ("loop_multiply_fusion_6", "elementwise"),
    ("wrapped_subtract_1", "elementwise"),
    ("triton_poi_fused_addmm_mul_silu_view_1", "elementwise"),
    # What no row names: sorting and indexing.
    ("void (anonymous namespace)::indexing_backward_kernel_stride_1<float>(long const*, long const*,"
     " float const*, "
     "float*, long, long, long, long, bool)", "other"),
    ("void spin_wait_kernel(int*)", "other"),
]


@pytest.mark.parametrize(("name", "expected"), NAMES)
def test_real_kernel_names_are_classified(name: str, expected: str) -> None:
    assert classify(Kind.KERNEL, name) == expected


def test_every_row_of_the_table_is_the_first_match_of_a_real_name() -> None:
    rows = [re.compile(pattern) for pattern, _ in TAXONOMY]
    first = {next((i for i, row in enumerate(rows) if row.search(without_parameters(name))), None)
             for name, _ in NAMES}
    assert first >= set(range(len(rows)))


def test_copies_and_fills_are_classified_by_their_kind() -> None:
    assert classify(Kind.MEMCPY, "Memcpy HtoD (Pageable -> Device)") == "memcpy"
    assert classify(Kind.MEMSET, "Memset (Device)") == "memset"


def test_argument_types_do_not_classify_a_kernel() -> None:
    """cuBLAS's scal kernel takes a cublasTransposeParams: it is not a transpose."""
    assert classify_name("void scal_kernel<float, float, 1, true, 6, 5, 5, 3>(cublasTransposeParams<float>, "
                         "float const*, float*, float const*)") == "other"


def test_log_softmax_is_told_from_attention_softmax() -> None:
    loss = ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 4, true, false>(float*, "
            "float const*, int, int, int, bool const*, int, bool)")
    attention = ("void (anonymous namespace)::softmax_warp_forward<c10::Half, c10::Half, float, 10, false, "
                 "false>(c10::Half*, c10::Half const*, int, int, int, bool const*, int, bool)")
    assert LOG_SOFTMAX.search(without_parameters(loss))
    assert not LOG_SOFTMAX.search(without_parameters(attention))
    assert LOG_SOFTMAX.search("cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>")


def test_short_names_drop_the_parameters_and_clip() -> None:
    assert short_name("void (anonymous namespace)::spin(int*)") == "spin"
    assert short_name("x" * 100, limit=10) == "x" * 9 + "…"
