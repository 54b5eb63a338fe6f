"""The control loop: observe > plan > act, liveness, cost, cron and the status snapshot."""
