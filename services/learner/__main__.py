from steadyrl.services.learner.main import main
from steadyrl.service import main_guard

main_guard(main)
