"""Engine integrations: code that runs inside a serving engine (vLLM's plugin and its generation worker).

It imports only ``draftsmith.core`` and never an engine at module import time, so loading the plugin's entry
point costs vLLM nothing and ``draftsmith doctor`` works where no engine is installed.
"""
