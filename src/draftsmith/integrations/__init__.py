"""Engine integrations: code that runs inside (or drives) a serving engine rather than draftsmith itself.

Nothing here imports an engine at module import time, so ``draftsmith doctor`` and ``draftsmith serve`` work
in an environment without the engine installed.
"""
