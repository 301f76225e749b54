"""The comparator TPDM (Ye et al., CVPR 2025): its step-wise policy and PPO update (tpdm.py)."""
