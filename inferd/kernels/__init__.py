"""Native kernels built on first use (C++ against PyTorch's extension API); see quant_gemm."""
