"""The enforcer: per-container accounting and limits (containers, engines, state)."""
