from steadyrl.service import main_guard
from steadyrl.services.reward.worker import main

main_guard(main)
