"""Training data: conversations, chat templates and loss masks, the feature store."""
