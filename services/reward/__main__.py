from steadyrl.services.reward.worker import main
from steadyrl.service import main_guard

main_guard(main)
