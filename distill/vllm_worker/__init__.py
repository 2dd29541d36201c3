"""The vLLM worker: the only place in distill that imports vllm.

It runs as a subprocess (`python -m distill.vllm_worker JOB.json RESULT.json`) so the rest of the package imports
without vLLM and an engine crash cannot take the pipeline down. Keep this file free of imports: vLLM loads
`distill.vllm_worker.plugin` through the `vllm.general_plugins` entry point in every process.
"""
