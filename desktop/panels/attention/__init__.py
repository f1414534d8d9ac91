"""The attention panel: live view, snapshots, the head atlas, the formula with numbers."""
