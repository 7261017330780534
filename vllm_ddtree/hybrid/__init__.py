"""Hybrid targets: recurrent layers (GatedDeltaNet, Mamba2) verify draft trees exactly."""
