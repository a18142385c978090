"""weightsync's two vLLM integrations: its worker extension, and a backend of vLLM's weight-transfer API.

This package imports nothing: vLLM loads `plugin` in every process, and only some
modules may import vLLM.
"""
