"""CPU kernels in C, built at first use (:mod:`kernels.cpu.build`): the GGUF-block GEMV
(:mod:`kernels.cpu.block_gemv`) and a whole decoder layer of a decode step
(:mod:`kernels.cpu.decode_layer`), each with its torch reference and tests comparing
them. Where they cannot be built, the engine keeps torch's CPU kernels."""
