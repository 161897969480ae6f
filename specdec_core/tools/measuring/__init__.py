"""What a step costs: `specdec gpu-report`, verify and draft costs, step operations, compile checks."""
