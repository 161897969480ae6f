"""Training heads and EAGLE-3 layers, and EntMTP's tree search (`specdec train-heads`, `frontier`)."""
