"""What serves train.py around its loop: setup and finish, the run folder, checkpoints, held-out
scores, realism, figures and trackers."""
