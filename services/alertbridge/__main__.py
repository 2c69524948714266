from steadyrl.service import main_guard
from steadyrl.services.alertbridge.bridge import main

main_guard(main)
