"""SimpleFSDP with compiled all-gathers and register_comm_hook (see issue: SimpleFSDP)."""
