"""The dock panels beside the chat: the KV-cache memory panel (kv/) and the attention view (attention/)."""
