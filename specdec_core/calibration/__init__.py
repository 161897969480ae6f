"""What is measured once and cached: the target's profile, a draft's costs, the question sets they measure on."""
