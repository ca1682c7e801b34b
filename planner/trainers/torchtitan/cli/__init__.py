"""torchtitan 0.3.x (target ``torchtitan-0.3``): a launch script of ``torchtitan.train`` flags over a
config-registry function, written and read back."""
