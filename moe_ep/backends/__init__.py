"""Communication backends behind moe_ep.Buffer (see base.py for the interface)."""
