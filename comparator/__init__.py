"""The comparator TPDM: its step-wise policy (stepwise.py) and its PPO update (ppo.py)."""
