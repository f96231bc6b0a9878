"""Backend choices, in one place: which routed-expert kernel a platform runs (``experts.pick``), how
quantized weights are read inside compiled loops (``dequant``), and the Pallas grouped matmuls that
dequantize in the kernel (``quant_gmm``: Mosaic on TPU, ``quant_gmm_gpu``: Triton; both also run in
Pallas interpret mode, which is how the tests check them on a CPU). ``models/`` holds the math.
"""
