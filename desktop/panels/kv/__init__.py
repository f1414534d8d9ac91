"""The KV-cache memory panel."""
