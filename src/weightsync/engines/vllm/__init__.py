"""weightsync's two vLLM integrations: its worker extension, and a backend of vLLM's weight-transfer API.

The map of the modules and the design behind them: docs/VLLM.md. This package imports
nothing: vLLM loads `plugin` in every process, and only some modules may import vLLM.
"""
