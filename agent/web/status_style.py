"""The status page's stylesheet, inline in the page (its Content-Security-Policy allows no other).

Below 800 px the alerts, GPUs and captures tables turn each row into a block whose cells wrap (an
alert's summary and a capture's verdict on lines of their own, a GPU's figures named), so that every
column stays in view; other wide tables scroll inside their own section, and the page never scrolls
sideways.

Colours say one thing each: green is well (a GPU up with its health ok, a healthy verdict), amber a
warning (a health warning, a finding of moderate severity), red a failure (a GPU down, a critical
health problem, a finding of high severity), grey no claim (an inconclusive or unreadable verdict).
"""

STATUS_PAGE_CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f3f4f6;color:#1f2328;
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Liberation Sans","DejaVu Sans",Arial,sans-serif}
header{background:#1f2937;color:#f9fafb;padding:12px 24px;display:flex;flex-wrap:wrap;gap:6px 18px;
 align-items:baseline}
header h1{font-size:22px;margin:0;font-weight:650}
header .sub{color:#d1d5db}
header .right{margin-left:auto}
.banner{padding:10px 24px;font-weight:600;font-size:15px}
.banner.sim{background:#fef3c7;color:#713f12;border-bottom:3px solid #f59e0b}
.banner.bad{background:#fee2e2;color:#7f1d1d;border-bottom:3px solid #dc2626}
main{padding:4px 24px 16px}
section{background:#fff;border:1px solid #d1d5db;border-radius:8px;margin:14px 0;overflow-x:auto}
h2{font-size:15px;margin:0;padding:9px 14px;background:#f9fafb;border-bottom:1px solid #e5e7eb}
h2 a{font-weight:400;font-size:13px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:6px 12px;border-bottom:1px solid #eef0f3;vertical-align:middle}
tbody tr:last-child td{border-bottom:0}
th{font-size:12px;color:#4b5563;font-weight:600;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.alert.firing,tr.alert.firing td{background:#fff5f5}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:700;
 white-space:nowrap;margin:1px 0}
.badge.firing,.badge.down{background:#dc2626;color:#fff}
.badge.clearing{background:#f59e0b;color:#fff}
.severity.critical{background:#7f1d1d;color:#fff;border-radius:3px;padding:0 4px;font-weight:600}
tr.alert.clearing,tr.alert.clearing td{background:#fffbeb}
.badge.inhibited{background:#e5e7eb;color:#4b5563}
tr.alert.inhibited td{color:#6b7280}
.inhibited-by{font-style:italic}
.badge.pending{background:#fcd34d;color:#422006}
.badge.up{background:#16a34a;color:#fff}
.badge.up.warning{background:#fef3c7;color:#713f12;box-shadow:inset 0 0 0 1px #f59e0b}
.badge.up.critical{background:#fee2e2;color:#7f1d1d;box-shadow:inset 0 0 0 1px #dc2626}
.badge.health.ok{background:#dcfce7;color:#14532d}
.badge.health.reset_required,.badge.health.warning{background:#f59e0b;color:#422006}
.badge.health.replace,.badge.health.lost,.badge.health.critical{background:#7f1d1d;color:#fff}
.health-reasons{color:#374151;margin-top:2px}
td.name{white-space:nowrap}
.verdict{font-weight:700;padding:0 5px;border-radius:3px}
.verdict.healthy{background:#dcfce7;color:#14532d}
.verdict.moderate{background:#fef3c7;color:#713f12}
.verdict.high{background:#fee2e2;color:#7f1d1d}
.verdict.unsure{background:#e5e7eb;color:#4b5563}
.headline{color:#374151;overflow-wrap:anywhere}
.fate.firing{color:#b91c1c;font-weight:600}
.fate.resolved{color:#15803d}
td.id{overflow-wrap:anywhere}
td.when{white-space:nowrap}
tr.mig td{background:#fafbfc;border-bottom-color:#f3f4f6}
tr.mig .mig-name{padding-left:10px;font-weight:600}
tr.mig .pods{padding-left:24px;color:#374151}
.outcome{font-weight:600}
.outcome.captured{color:#15803d}
.outcome.refused{color:#b45309}
h3.refusals{font-size:14px;margin:0;padding:9px 14px;border-top:1px solid #e5e7eb;background:#f9fafb}
.outcome.failed,.outcome.unreachable,.outcome.exited{color:#b91c1c}
.nowrap{white-space:nowrap}
.banner code{font-size:inherit}
.muted{color:#6b7280}
.small{font-size:12px}
.ok{color:#15803d}
p.note{padding:10px 14px;margin:0}
code,.mono{font-family:ui-monospace,"SFMono-Regular","DejaVu Sans Mono","Liberation Mono",Menlo,Consolas,
 monospace;font-size:12px}
.pname{font-weight:600;overflow-wrap:anywhere}
.util{display:flex;align-items:center;gap:10px}
.util .num{min-width:3.2em;text-align:right;font-variant-numeric:tabular-nums}
svg.spark{display:block}
svg.spark rect{fill:#eff6ff;stroke:#dbeafe}
svg.spark polyline{fill:none;stroke:#2563eb;stroke-width:1.5;stroke-linejoin:round}
svg.spark circle{fill:#2563eb}
svg.spark polygon{fill:#93c5fd}
a{color:#1d4ed8}
footer{padding:4px 24px 24px;color:#6b7280;font-size:13px}
#alerts td:last-child{min-width:14em}
@media (max-width:800px){
 header,.banner{padding-left:12px;padding-right:12px}
 header .right{margin-left:0}
 main{padding:2px 8px 12px}
 footer{padding:4px 12px 16px}
 th,td{padding:5px 7px}
 #alerts table,#alerts tbody{display:block}
 #alerts thead{display:none}
 #alerts tr.alert{display:flex;flex-wrap:wrap;align-items:baseline;gap:2px 12px;padding:7px 10px;
  border-bottom:1px solid #eef0f3}
 #alerts tr.alert td{padding:0;border:0}
 #alerts tr.alert td:nth-child(3)::before{content:"GPU "}
 #alerts tr.alert td:nth-child(5)::before{content:"for "}
 #alerts tr.alert td:last-child{flex-basis:100%;min-width:0;overflow-wrap:anywhere}
 #gpus table,#gpus tbody,#captures table,#captures tbody{display:block}
 #gpus thead,#captures thead{display:none}
 #gpus tr,#captures tr{display:flex;flex-wrap:wrap;align-items:center;gap:3px 12px;padding:7px 10px;
  border-bottom:1px solid #eef0f3}
 #gpus td,#captures td{padding:0;border:0;min-width:0}
 #gpus td:empty{display:none}
 #gpus tr.gpu td.index::before{content:"GPU "}
 #gpus td.name{white-space:normal}
 #gpus td.mem::before{content:"memory "}
 #gpus td.power::before{content:"power "}
 #gpus td.procs::before{content:"processes "}
 #gpus td.mem::before,#gpus td.power::before,#gpus td.procs::before{color:#6b7280;font-size:12px}
 #captures tr td:nth-child(2)::before{content:"GPU "}
 #captures tr td:last-child{flex-basis:100%}
 #captures tr.capture td:nth-child(3){flex-basis:100%;order:-1}
}
"""
