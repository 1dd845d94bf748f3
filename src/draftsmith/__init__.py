"""draftsmith: forge EAGLE-3 drafters for any LLM and prove them before deployment."""

__version__ = "0.1.0"
