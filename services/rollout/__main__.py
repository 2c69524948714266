from steadyrl.service import main_guard
from steadyrl.services.rollout.worker import main

main_guard(main)
