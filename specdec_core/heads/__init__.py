"""The target's own draft heads: their contract, Medusa, Hydra, EAGLE-3 (layer, checkpoint, session), loading."""
