"""How a CT reaches Qwen3-VL, shared by training (`train/`) and mining (`inference/`): the frames-to-video encoding
(`model_io.video`), the processor and chat layout (`model_io.processor`), the standard checkpoint files
(`model_io.checkpoint`) and what vLLM needs to serve such a checkpoint (`model_io.vllm_support`).

Imports no package of the project. `model_io.checkpoint` and `model_io.vllm_support` use the standard library only;
`model_io.video` and `model_io.processor` import torch and transformers.
"""
