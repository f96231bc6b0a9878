"""Pallas kernels: grouped matmuls over quantized expert stacks that dequantize inside the kernel.

``quant_gmm`` holds the TPU (Mosaic) kernels; each also runs in Pallas interpret mode on any
backend, which is how the tests check them against the exact dequantized reference on a CPU.
"""
