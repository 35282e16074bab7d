"""The one engine loop, the state it owns, and the contract policies and runners share (plan, view, batch)."""
